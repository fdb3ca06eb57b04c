"""How much of the checkpoint a build has streamed: the unit of `builder build`'s progress.

A build's long part is streaming every checkpoint tensor into weights.bin (quantising it on the way).
`CountedSource` wraps the build's TensorSource and reports the checkpoint bytes read so far against
the checkpoint's total: each tensor counts up to its own size, so a tensor read twice (a check, then
the write) is not counted twice, and the figure never passes the total.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import numpy as np

from builder.network import TensorSource


class CountedSource:
    """`source` (a TensorSource over `tensors`, a gsm.checkpoint.CheckpointTensors) that calls `read(done, total)`,
    checkpoint bytes, after every chunk it yields."""

    def __init__(self, source: TensorSource, tensors: object, read: Callable[[int, int], None]) -> None:
        self.source, self.read = source, read
        infos = {n: tensors.reader(n).info(n) for n in tensors.names}  # type: ignore[attr-defined]
        self.size = {n: i.nbytes for n, i in infos.items()}
        self.itemsize = {n: i.nbytes / max(1, i.numel) for n, i in infos.items()}  # stored bytes per value
        self.total = sum(self.size.values())
        self.counted: dict[str, int] = {}
        self.done = 0

    def shape(self, name: str) -> tuple[int, ...]:
        return self.source.shape(name)

    def chunks(self, name: str) -> Iterable[np.ndarray]:
        return self._counted(name, self.source.chunks(name))

    def _counted(self, name: str, chunks: Iterable[np.ndarray]) -> Iterator[np.ndarray]:
        for c in chunks:
            yield c
            if name in self.size:
                had = self.counted.get(name, 0)
                now = min(self.size[name], had + round(c.size * self.itemsize[name]))
                self.counted[name] = now
                self.done += now - had
            self.read(self.done, self.total)
