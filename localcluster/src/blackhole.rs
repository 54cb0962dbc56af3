//! A partition around one loopback address's TCP port, made by the kernel:
//! iptables drops the packets both ways, so nothing is acknowledged and nothing is reset
//! (unlike a stopped process, whose kernel still answers). Needs root; the rules are
//! removed when the value is dropped, panics included.

use std::{net::Ipv4Addr, process::Command};

#[derive(Debug)]
pub struct Blackhole {
    rules: Vec<Vec<String>>,
}

#[derive(Debug, thiserror::Error)]
pub enum BlackholeError {
    #[error("iptables {args}: {reason}")]
    Iptables { args: String, reason: String },
}

/// Run `iptables -w <args>` (waiting for the xtables lock).
fn iptables(args: &[String]) -> Result<(), BlackholeError> {
    let failed = |reason: String| BlackholeError::Iptables { args: args.join(" "), reason };
    let out = Command::new("iptables").arg("-w").args(args).output().map_err(|e| failed(e.to_string()))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(failed(String::from_utf8_lossy(&out.stderr).trim().to_owned()))
    }
}

impl Blackhole {
    /// Whether this process may change the firewall (root).
    pub fn permitted() -> bool {
        nix::unistd::Uid::effective().is_root()
    }

    /// Drop every packet to and from `server`'s `port`, whoever the other end is (on
    /// loopback a client's source address is not its own listener's, so it cannot be
    /// told apart by address).
    pub fn port(server: Ipv4Addr, port: u16) -> Result<Blackhole, BlackholeError> {
        let (server, port) = (server.to_string(), port.to_string());
        let inbound = ["INPUT", "-d", &server, "-p", "tcp", "--dport", &port, "-j", "DROP"];
        let outbound = ["INPUT", "-s", &server, "-p", "tcp", "--sport", &port, "-j", "DROP"];
        let mut hole = Blackhole { rules: Vec::new() };
        for rule in [inbound, outbound] {
            let rule: Vec<String> = rule.iter().map(|s| s.to_string()).collect();
            let insert: Vec<String> = std::iter::once("-I".to_owned()).chain(rule.iter().cloned()).collect();
            iptables(&insert)?; // on error, the rules inserted so far go with `hole`
            hole.rules.push(rule);
        }
        Ok(hole)
    }
}

impl Drop for Blackhole {
    fn drop(&mut self) {
        for rule in self.rules.drain(..) {
            let delete: Vec<String> = std::iter::once("-D".to_owned()).chain(rule).collect();
            if let Err(e) = iptables(&delete) {
                eprintln!("blackhole: could not remove a rule: {e}");
            }
        }
    }
}
