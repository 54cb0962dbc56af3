//! Print the AgentCluster CRD, or with `--write` write it to every checked-in location.

use std::path::Path;

fn main() -> std::io::Result<()> {
    let yaml = leasehold_crds::crd_yaml();
    if std::env::args().any(|a| a == "--write") {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        for path in leasehold_crds::CRD_PATHS {
            let path = root.join(path);
            std::fs::create_dir_all(path.parent().expect("has a parent"))?;
            std::fs::write(&path, &yaml)?;
            eprintln!("wrote {}", path.display());
        }
    } else {
        print!("{yaml}");
    }
    Ok(())
}
