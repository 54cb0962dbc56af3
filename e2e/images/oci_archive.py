#!/usr/bin/env python3
"""Write a single-layer OCI image archive (tar of an OCI image layout) from a rootfs dir.

Deterministic: entries sorted, mtimes fixed at 0, owner 0:0, gzip header without a
timestamp or name. The index.json entry carries both `io.containerd.image.name` (the
full name: `ctr images import` registers it as-is) and `org.opencontainers.image.ref.name`
(the tag). Python 3 stdlib only.

usage: oci_archive.py --rootfs DIR --name REPO:TAG --entrypoint PATH [ARG...]
                      [--user UID:GID] [--env K=V]... --out FILE
"""
import argparse
import gzip
import hashlib
import io
import json
import os
import sys
import tarfile

MT_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MT_INDEX = "application/vnd.oci.image.index.v1+json"
MT_CONFIG = "application/vnd.oci.image.config.v1+json"
MT_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"
EPOCH = "1970-01-01T00:00:00Z"


def canonical(obj):
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def sha256(data):
    return "sha256:" + hashlib.sha256(data).hexdigest()


def normalize(info):
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    return info


def layer_tar(rootfs):
    """The rootfs as an uncompressed tar, entries in sorted order, no root entry."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        def add(rel):
            path = os.path.join(rootfs, rel)
            info = normalize(tar.gettarinfo(path, arcname=rel))
            if info.isreg():
                with open(path, "rb") as f:
                    tar.addfile(info, f)
            else:
                tar.addfile(info)
            if info.isdir():
                for name in sorted(os.listdir(path)):
                    add(os.path.join(rel, name))

        for name in sorted(os.listdir(rootfs)):
            add(name)
    return buf.getvalue()


def blob_entry(tar, data):
    digest = sha256(data)
    info = normalize(tarfile.TarInfo("blobs/sha256/" + digest.split(":", 1)[1]))
    info.size = len(data)
    info.mode = 0o644
    tar.addfile(info, io.BytesIO(data))
    return digest


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rootfs", required=True)
    p.add_argument("--name", required=True, help="full image name, e.g. docker.io/x/y:tag")
    p.add_argument("--entrypoint", required=True, nargs="+")
    p.add_argument("--user", default="")
    p.add_argument("--env", action="append", default=[])
    p.add_argument("--out", required=True)
    a = p.parse_args()

    repo, sep, tag = a.name.rpartition(":")
    if not sep or "/" in tag:
        sys.exit(f"oci_archive.py: --name {a.name!r} has no tag")

    raw = layer_tar(a.rootfs)
    layer = gzip.compress(raw, compresslevel=6, mtime=0)
    config = canonical({
        "architecture": "amd64",
        "os": "linux",
        "created": EPOCH,
        "config": {"Entrypoint": a.entrypoint, "User": a.user, "Env": a.env, "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": [sha256(raw)]},
        "history": [{"created": EPOCH, "created_by": "e2e/images/oci_archive.py"}],
    })

    tmp = a.out + ".tmp"
    with open(tmp, "wb") as f, tarfile.open(fileobj=f, mode="w", format=tarfile.GNU_FORMAT) as tar:
        layer_digest = blob_entry(tar, layer)
        config_digest = blob_entry(tar, config)
        manifest = canonical({
            "schemaVersion": 2,
            "mediaType": MT_MANIFEST,
            "config": {"mediaType": MT_CONFIG, "digest": config_digest, "size": len(config)},
            "layers": [{"mediaType": MT_LAYER, "digest": layer_digest, "size": len(layer)}],
        })
        manifest_digest = blob_entry(tar, manifest)
        index = canonical({
            "schemaVersion": 2,
            "mediaType": MT_INDEX,
            "manifests": [{
                "mediaType": MT_MANIFEST,
                "digest": manifest_digest,
                "size": len(manifest),
                "platform": {"architecture": "amd64", "os": "linux"},
                "annotations": {
                    "io.containerd.image.name": a.name,
                    "org.opencontainers.image.ref.name": tag,
                },
            }],
        })
        for name, data in (("index.json", index), ("oci-layout", canonical({"imageLayoutVersion": "1.0.0"}))):
            info = normalize(tarfile.TarInfo(name))
            info.size = len(data)
            info.mode = 0o644
            tar.addfile(info, io.BytesIO(data))
    os.replace(tmp, a.out)
    print(f"{a.out}: {a.name} {manifest_digest}")


if __name__ == "__main__":
    main()
