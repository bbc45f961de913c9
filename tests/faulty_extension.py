"""rlfleet's worker extension with one fault a test can arm (`--worker-extension-cls
tests.faulty_extension.FaultyExtension`): the next weight load fails half-way, after the
model has taken some of the new tensors, as a checkpoint that vanishes or a disk that fails
mid-read would make it fail."""

from __future__ import annotations

from rlfleet.vllm.extension import WorkerExtension


class FaultyExtension(WorkerExtension):
    _fail_after: int | None = None

    def fault_fail_next_load(self, after: int) -> bool:
        """The next load raises after handing `after` tensors to the model."""
        self._fail_after = after
        return True

    def _rlfleet_apply(self, tensors, known_digest=None):
        after, self._fail_after = self._fail_after, None
        if after is None:
            return super()._rlfleet_apply(tensors, known_digest)
        calls = 0

        def failing():
            nonlocal calls
            calls += 1
            for i, item in enumerate(tensors()):
                if calls > 1 and i == after:  # the checks passed; the model is half-loaded
                    raise OSError("injected: the checkpoint became unreadable mid-load")
                yield item
        return super()._rlfleet_apply(failing, known_digest)
