"""Entry point of a process started by the local launcher (``python -m plexus.train.process``).

Reads who it is from the environment, the job from ``PLEXUS_CONFIG``, joins the store,
runs its role, and turns a plexus error into one line on stderr and its exit status.
"""
from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path


def main() -> int:
    from plexus.cluster.child import prepare_child
    prepare_child()
    debug = bool(os.environ.get("PLEXUS_DEBUG"))
    logging.basicConfig(level=logging.INFO if debug else logging.WARNING, format="%(message)s", stream=sys.stderr,
                        force=True)  # a forked child replaces the handlers it inherited
    from plexus.cluster.rendezvous import ProcessInfo, connect_store
    from plexus.config import JobConfig
    from plexus.errors import PlexusError
    from plexus.train.runner import load_saved_dataset, role_main, worker_main

    info = ProcessInfo.from_env()
    try:
        cfg = JobConfig.from_dict(json.loads(Path(os.environ["PLEXUS_CONFIG"]).read_text()))
        store = connect_store(info, cfg.cluster.timeout)
        run_dir = Path(os.environ["PLEXUS_RUN_DIR"]) if os.environ.get("PLEXUS_RUN_DIR") else None
        if info.role == "worker":
            data = load_saved_dataset(Path(os.environ["PLEXUS_DATA"])) if os.environ.get("PLEXUS_DATA") else None
            worker_main(cfg, info, store, run_dir, data)
        else:
            role_main(cfg, info, store, run_dir)
    except PlexusError as exc:
        if debug:
            logging.exception("%s failed", info.name)
        else:
            print(f"{exc}" if str(exc).startswith(info.name) else f"{info.name}: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
