"""The arguments of ``python -m rlfleet.vllm``: vLLM's own engine arguments
(``AsyncEngineArgs.add_cli_args``, and ``--config FILE.yaml`` as ``vllm serve`` reads it)
beside rlfleet's worker flags, parsed once and checked in one place.

Engine settings rlfleet relies on, and who decides them:

- ``--served-model-name``: default the ``--model`` string (as vLLM and Dynamo name it);
  several names are refused (a worker registers one model name).
- ``--logprobs-mode``: default ``processed_logprobs`` (the sampling distribution a trainer's
  importance ratio needs); ``raw_logprobs`` allowed; the ``*_logits`` modes are refused
  (the wire carries log-probabilities).
- ``--max-logprobs``: default 20; at least 20 (or -1) enforced: the contract promises top-20.
- ``--enable-prefix-caching``: vLLM's default (on); may be turned off. rlfleet resets the
  cache after every weight load either way.
- ``--worker-extension-cls``: rlfleet's, or a subclass of it, enforced (weight loading,
  digests and the trainer broadcast live there).
- ``--skip-tokenizer-init``: refused (the worker tokenizes prompts and renders chat).
- ``--enable-lora``, ``--max-loras``, ``--max-lora-rank``: vLLM's; ``--lora-modules``
  (``vllm serve``'s flag) loads adapters at start-up and needs ``--enable-lora``.
- ``--weight-transfer-config``: vLLM's, passed to vLLM as given, except on vLLM's CPU build
  with ``{"backend": "modelexpress"}``: the worker runs that backend itself over rlfleet's
  weight plane (rlfleet.worker.modelexpress) and vLLM's engine gets none (its own
  ModelExpress engine is not installed in the workers: its package is kept out of them).

Everything else is vLLM's default unless given; machine-specific choices (the CPU build's
in-process engine, KV-cache size) live in the set-up's environment file, not here.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from vllm.config.weight_transfer import WeightTransferConfig
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.launchers.cli_args import LoRAParserAction
from vllm.platforms import current_platform
from vllm.utils.argparse_utils import FlexibleArgumentParser

from rlfleet.protocol import modelexpress
from rlfleet.protocol.engine import MAX_LOGPROBS
from rlfleet.worker.serve import add_worker_args, settle_worker_args

EXTENSION = "rlfleet.vllm.extension.WorkerExtension"

# defaults a user may override (on the command line or in --config)
DEFAULTS = {
    "logprobs_mode": "processed_logprobs",
    "max_logprobs": MAX_LOGPROBS,
    "worker_extension_cls": EXTENSION,
}


class WorkerArgumentParser(FlexibleArgumentParser):
    """vLLM's parser (``--config``, ``--json.key value``, dashes or underscores), with a
    ``--help`` that lists every argument (``--help=GROUP`` or ``--help=word`` to narrow)."""

    def format_help(self) -> str:
        if FlexibleArgumentParser._search_keyword is not None:
            return super().format_help()
        return argparse.ArgumentParser.format_help(self)


def build_parser() -> WorkerArgumentParser:
    p = WorkerArgumentParser(
        prog="python -m rlfleet.vllm",
        description="An rlfleet worker around the vLLM engine: vLLM's engine arguments, "
                    "then rlfleet's worker flags. `--config FILE.yaml` reads any of them from "
                    "YAML (command-line flags win).")
    p.add_argument("--config", default=None,
                   help="YAML file of arguments (keys as flag names, e.g. "
                        "`tensor-parallel-size: 2`), as `vllm serve --config` reads it")
    AsyncEngineArgs.add_cli_args(p)
    add_worker_args(p)
    g = p.add_argument_group("rlfleet engine")
    g.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="skip the start-up request that compiles the logprobs kernels")
    g.add_argument("--staged-apply", choices=["swap", "reload"], default="swap",
                   help="how a staged version is installed: swap (default: reloaded into a "
                        "shadow of the model while serving, then swapped in within the gated "
                        "window; holds a second copy of the weights on the engine's device "
                        "meanwhile) or reload (in place, inside the window)")
    g.add_argument("--lora-modules", type=str, default=None, nargs="+",
                   action=LoRAParserAction,
                   help="LoRA adapters to serve from the start (needs --enable-lora), as "
                        "`vllm serve` takes them: name=path, or JSON {\"name\", \"path\"}; "
                        "more are loaded at run time with POST /v1/load_lora_adapter or "
                        "/engine/load_lora_adapter")
    p.set_defaults(**DEFAULTS)
    return p


def served_name(args: argparse.Namespace) -> str:
    names = args.served_model_name
    if isinstance(names, str):
        return names
    return names[0] if names else args.model


def check(args: argparse.Namespace) -> None:
    """The settings rlfleet enforces; ValueError says what to change."""
    names = args.served_model_name
    if isinstance(names, list) and len(names) > 1:
        raise ValueError(f"--served-model-name: a worker serves one name, got {names}")
    if not str(args.logprobs_mode).endswith("_logprobs"):
        raise ValueError(f"--logprobs-mode {args.logprobs_mode}: rlfleet returns log-probabilities;"
                         " use processed_logprobs (default) or raw_logprobs")
    if args.max_logprobs != -1 and args.max_logprobs < MAX_LOGPROBS:
        raise ValueError(f"--max-logprobs {args.max_logprobs}: the contract allows up to "
                         f"{MAX_LOGPROBS} logprobs per token; use at least {MAX_LOGPROBS} or -1")
    settle_worker_args(args)
    if args.lora_modules and not args.enable_lora:
        raise ValueError("--lora-modules: serving adapters needs --enable-lora")
    if args.skip_tokenizer_init:
        raise ValueError("--skip-tokenizer-init: the worker needs the tokenizer (prompts, chat)")
    if args.worker_extension_cls != EXTENSION:
        from rlfleet.vllm.extension import WorkerExtension

        module, _, name = args.worker_extension_cls.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError, ValueError) as e:
            raise ValueError(f"--worker-extension-cls {args.worker_extension_cls}: cannot import "
                             f"it ({e})") from e
        if not (isinstance(cls, type) and issubclass(cls, WorkerExtension)):
            raise ValueError(f"--worker-extension-cls {args.worker_extension_cls}: must be "
                             f"{EXTENSION} or a subclass of it")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and check; a bad argument exits with a message, as argparse does."""
    p = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    for i, a in enumerate(argv):  # vLLM's parser reads `--config FILE` only
        if a.startswith("--config="):
            argv[i:i + 1] = ["--config", a.split("=", 1)[1]]
            break
    try:
        args = p.parse_args(argv)
        check(args)
    except ValueError as e:
        p.error(str(e))
    return args


def own_transfer_backend(args: argparse.Namespace) -> str | None:
    """The --weight-transfer-config backend the worker runs itself instead of vLLM: the
    modelexpress one on vLLM's CPU build (where the official engine's does not run); None on
    a GPU build, and for every other backend (vLLM's own, or refused on a CPU build)."""
    config = args.weight_transfer_config
    if config is None or config.backend != modelexpress.BACKEND or not current_platform.is_cpu():
        return None
    return modelexpress.BACKEND


def weight_transfer_backend(args: argparse.Namespace) -> str:
    """The weight-transfer backend the worker's engine was started with, as discovery names
    it: --weight-transfer-config's, else vLLM's default (its WeightTransferConfig's)."""
    return (args.weight_transfer_config or WeightTransferConfig()).backend


def engine_args(args: argparse.Namespace) -> AsyncEngineArgs:
    """vLLM's engine arguments from the parsed command line, with the served name resolved
    (and no weight-transfer config where the worker runs the backend itself)."""
    ea = AsyncEngineArgs.from_cli_args(args)
    ea.served_model_name = [served_name(args)]
    if own_transfer_backend(args) is not None:
        ea.weight_transfer_config = None
    return ea
