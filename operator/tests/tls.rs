//! The operator talks to real API servers over HTTPS: its kube client must have a TLS
//! crypto provider compiled in (without one, rustls panics when the client is built).

#[tokio::test]
async fn an_https_kube_client_can_be_built() {
    let config = kube::Config::new("https://127.0.0.1:6443".parse().unwrap());
    let client = kube::Client::try_from(config);
    assert!(client.is_ok(), "building an HTTPS client failed: {:?}", client.err());
}
