"""TRL's asynchronous GRPO trainer (`trl.experimental.async_grpo.AsyncGRPOTrainer`, TRL
1.16+) with its rollouts from an rlfleet fleet and its weight syncs as fleet refreshes.

    fleet = Fleet(frontend_url, "tiny", rl_url=rl_url, mode="rolling", max_lag=2)
    link = FleetAsyncLink(fleet, checkpoints="checkpoints", base=model_dir, max_staleness=2)
    worker = FleetRolloutWorker(link, dataset, reward_funcs, tokenizer, num_generations=8)
    trainer = AsyncGRPOTrainer(model=model_dir, reward_funcs=reward_funcs, args=args,
                               train_dataset=dataset, rollout_worker=worker,
                               weight_transfer=FleetWeightTransfer(link))

TRL's two hooks, both from its own protocols (`RolloutWorkerProtocol`,
`WeightTransferProtocol`):

- `FleetRolloutWorker` fills TRL's rollout queue from `Fleet.stream_rollouts`: one
  request of n = num_generations per dataset prompt, scored by TRL-style reward functions,
  group-normalised advantages, the engine's prompt IDs, completion IDs and logprobs. A
  sample reaches the queue only when every token's policy is within `max_staleness` steps
  of the trainer's (rlfleet's bound, per token span), and it is tagged with the TRL
  model version of its *oldest* token, so that TRL's own `max_staleness` drop (which
  sees one version per sample) never admits a token rlfleet would not.
- `FleetWeightTransfer` turns each of TRL's weight syncs into a published step: the
  streamed tensors are written as checkpoints/step-N and the fleet moves to it with a
  refresh (rolling with a rolling Fleet: no fleet-wide pause, so `pause`/`resume` do
  nothing), the trainer not waiting for it. The first sync (at train begin) refreshes
  the whole fleet synchronously and waits (it also admits gated workers).

TRL's model version and the fleet step move together: version v is fleet step
`link.first_step + v - 1`.
"""

from __future__ import annotations

import asyncio
import queue
import shutil
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlfleet.refresh.coordinator import PolicyRefresh
from rlfleet.rl.fleet import Fleet
from rlfleet.rl.stream import RolloutStream, StreamedSample
from rlfleet.rollout.sample import Chat, SampleRequest, SamplingSpec
from rlfleet.train.checkpoint import save_checkpoint


class FleetAsyncLink:
    """What the two hooks share: the Fleet, the stream (once rollouts start), the published
    steps. `base`: the model's checkpoint directory (config and tokenizer files go next to
    each policy); `keep_checkpoints`: policies kept on disk (at least max_staleness + 2:
    a recovery may need the one before the oldest served)."""

    def __init__(self, fleet: Fleet, checkpoints: str | Path, base: str | Path, *,
                 max_staleness: int = 1, keep_checkpoints: int | None = None) -> None:
        if fleet.coordinator is None:
            raise ValueError("the Fleet needs an rl_url: every weight sync refreshes it")
        self.fleet, self.max_staleness = fleet, max_staleness
        self.checkpoints, self.base = Path(checkpoints).resolve(), Path(base)
        self.keep = max(keep_checkpoints or 0, max_staleness + 2)
        self.stream: RolloutStream | None = None
        self.first_step: int | None = None  # the fleet step of TRL's model version 1
        self.version = 0  # TRL's model version (weight syncs so far)
        self._saved: list[Path] = []

    def publish(self, tensors: dict[str, torch.Tensor]) -> None:
        self.version += 1
        coord = self.fleet.coordinator
        step = (coord.current.step + 1 if coord.current is not None and
                coord.current.step is not None else 0) if self.first_step is None \
            else self.first_step + self.version - 1
        name = f"step-{step}"
        path = save_checkpoint(tensors, self.base, self.checkpoints / name)
        self._saved.append(path)
        if self.first_step is None:  # the whole fleet, synchronously: workers then declare it
            # (its journal is the Fleet's coordinator's, which closes it)
            sync = PolicyRefresh(config=coord.config.replace(mode="sync"), journal=coord.journal,
                                 on_event=coord.on_event)
            result = asyncio.run(sync.refresh(path, name, step=step))
            if not result.ok:
                raise RuntimeError(f"the first weight sync did not reach the fleet: "
                                   f"{result.decision}: {result.reason}")
            self.first_step = step
        elif self.stream is not None:
            self.stream.publish(path, name, step=step)
        else:
            result = self.fleet.refresh(path, name, step=step)
            if not result.ok:
                raise RuntimeError(f"weight sync {name}: {result.decision}: {result.reason}")
        while len(self._saved) > self.keep:
            shutil.rmtree(self._saved.pop(0), ignore_errors=True)


class FleetWeightTransfer:
    """TRL `WeightTransferProtocol`: each sync publishes a fleet step (see the module doc)."""

    def __init__(self, link: FleetAsyncLink) -> None:
        self.link = link

    def init_weight_transfer(self) -> None:
        """Nothing to set up: the weights travel as checkpoints."""

    def pause(self) -> None:
        """Nothing: a refresh pauses the workers it moves, wave by wave."""

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        self.link.publish({name: t.detach().to("cpu") for name, t in iterator})

    def resume(self) -> None:
        """Nothing (see pause)."""

    def destroy(self) -> None:
        if self.link.stream is not None:
            self.link.stream.close()


RewardFunc = Callable[..., Sequence[float | None]]


class FleetRolloutWorker:
    """TRL `RolloutWorkerProtocol` on `Fleet.stream_rollouts` (see the module doc).
    `dataset`: rows with a "prompt" (text, chat messages or token IDs) and any columns the
    reward functions take; `tokenizer`: decodes completions for the reward functions;
    `batch_size`: prompts per stream batch; `queue_size`: samples the queue holds."""

    def __init__(self, link: FleetAsyncLink, dataset: Sequence[dict[str, Any]],
                 reward_funcs: Sequence[RewardFunc], tokenizer: Any, *, num_generations: int,
                 sampling: SamplingSpec, batch_size: int = 1, queue_size: int = 256,
                 run_id: str = "trl") -> None:
        self.link, self.dataset, self.reward_funcs = link, dataset, list(reward_funcs)
        self.tokenizer, self.g, self.sampling = tokenizer, num_generations, sampling
        self.batch_size, self.run_id = batch_size, run_id
        self.rollout_buffer: queue.Queue = queue.Queue(maxsize=queue_size)
        self.metrics_queue: queue.Queue = queue.Queue()
        self.model_version = 0
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._beat = time.time()

    def _requests(self) -> Iterator[SampleRequest]:
        i = 0
        while True:
            row = self.dataset[i % len(self.dataset)]
            p = row["prompt"]
            prompt = Chat(p) if isinstance(p, list) and p and isinstance(p[0], dict) else p
            yield SampleRequest(f"{self.run_id}/{i}", prompt, self.sampling, n=self.g)
            i += 1

    def start(self) -> None:
        link = self.link
        if link.first_step is None:
            raise RuntimeError("start the worker after the first weight sync (TRL does)")
        link.stream = link.fleet.stream_rollouts(
            self._requests(), self.batch_size, max_staleness=link.max_staleness,
            start_step=link.first_step + link.version - 1)
        self._thread = threading.Thread(target=self._run, name="rlfleet-trl-rollouts",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    batch = self.link.stream.next_batch(timeout=5)
                except TimeoutError:
                    self._beat = time.time()
                    continue
                for x in batch:
                    for s in self.samples(x):
                        while not self._stop.is_set():
                            try:
                                self.rollout_buffer.put(s, timeout=1)
                                break
                            except queue.Full:
                                self._beat = time.time()
                self._beat = time.time()
        except BaseException as e:  # surfaced by check_health on the trainer's thread
            if not self._stop.is_set():
                self._error = e

    def samples(self, x: StreamedSample) -> list[Any]:
        """TRL RolloutSamples of one admitted group: rewards, advantages, the version of its
        oldest token (TRL's counter)."""
        from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

        s = x.sample
        row = self.dataset[int(x.origin.rsplit("/", 1)[1]) % len(self.dataset)]
        texts = [self.tokenizer.decode(c.token_ids, skip_special_tokens=True)
                 for c in s.completions]
        extra = {k: [v] * len(texts) for k, v in row.items() if k != "prompt"}
        columns = [list(f(prompts=[row["prompt"]] * len(texts), completions=texts,
                          completion_ids=[list(c.token_ids) for c in s.completions], **extra))
                   for f in self.reward_funcs]
        rewards = np.nansum(np.array(columns, dtype=float).reshape(len(columns), -1), axis=0)
        adv = (rewards - rewards.mean()) / (rewards.std() + 1e-8)
        version = self.link.version - x.staleness  # x.staleness counts from the oldest token
        n_prompt = len(s.prompt_ids)
        return [RolloutSample(
            prompt=row["prompt"], completion=texts[k],
            input_ids=np.asarray(list(s.prompt_ids) + list(c.token_ids), dtype=np.int64),
            completion_mask=np.asarray([0] * n_prompt + [1] * len(c.token_ids), dtype=np.int64),
            old_log_probs=np.asarray([0.0] * n_prompt + list(c.logprobs), dtype=np.float32),
            advantage=float(adv[k]), model_version=version,
            group_id=hash(x.origin) & 0x7FFFFFFF,
            metrics={"reward": float(rewards[k]), "rlfleet/staleness": float(x.staleness)},
            enqueued_at=time.time()) for k, c in enumerate(s.completions)]

    def update_model_version(self, model_version: int) -> None:
        self.model_version = model_version

    def check_health(self, stale_after_s: float) -> None:
        if self._error is not None:
            raise RuntimeError(f"the fleet rollout worker failed: {self._error!r}") from self._error
        if time.time() - self._beat > stale_after_s:
            raise RuntimeError(f"the fleet rollout worker has not moved for {stale_after_s:.0f} s")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)
        if self.link.stream is not None:
            self.link.stream.close()
