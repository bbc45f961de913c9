"""python -m rlfleet.vllm --model MODEL [vLLM engine arguments] [--config FILE.yaml]
                       [--enable-rl] [--discovery URL] [--host H] [--advertise-host A] ...

`--help` lists everything; the engine settings rlfleet decides are in rlfleet.vllm.args."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    import uvloop

    from rlfleet.runtime.logs import quiet_engine_logging

    # before vLLM is imported: its level (WARNING unless debug), and in json format its
    # lines, its import-time ones too, go through rlfleet's handler and the output stays JSON
    quiet_engine_logging(sys.argv[1:] if argv is None else argv)
    from rlfleet.vllm.args import parse_args
    from rlfleet.vllm.engine import VllmEngine
    from rlfleet.worker.admin import EngineAdmin
    from rlfleet.worker.native_rl import NativeRL
    from rlfleet.worker.serve import serve_worker, staging_area

    args = parse_args(argv)
    engine = VllmEngine(args, fork_core=True)
    staging = staging_area(args, engine)
    admin = EngineAdmin(engine, args.allowed_weights_root, staging=staging)
    # on uvloop, as `vllm serve` runs its engine's client: every token of every request
    # crosses this event loop (vLLM's output handler, the stream plane)
    uvloop.run(serve_worker(engine, args, admin.routes, staging=staging,
                            admission=admin.admission, fence=admin.fence,
                            mounted=NativeRL(admin)))


if __name__ == "__main__":
    main()
