"""The protocol schemas, loaded from the repository's proto/ (or KEEP_PROTO_DIR)."""
import os
import pathlib

import capnp

capnp.remove_import_hook()


def proto_dir():
    """KEEP_PROTO_DIR, else the proto/ of the checkout this package lives in."""
    env = os.environ.get("KEEP_PROTO_DIR")
    if env:
        return pathlib.Path(env)
    here = pathlib.Path(__file__).resolve().parent
    for up in (here.parent.parent.parent / "proto", here / "proto"):
        if (up / "manager.capnp").exists():
            return up
    raise ImportError("keep_client: no proto/ schemas found; set KEEP_PROTO_DIR to the "
                      "repository's proto directory")


def _load(name):
    base = proto_dir()
    # "/capnp/c++.capnp" is imported by every schema: pycapnp ships it inside its package.
    site = pathlib.Path(capnp.__file__).resolve().parent.parent
    return capnp.load(str(base / name), imports=[str(base), str(site)])


manager = _load("manager.capnp")
worker = _load("worker.capnp")
