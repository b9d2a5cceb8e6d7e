"""Teacher-forced decoding through the real memory path.

``TeacherForcedDriver`` is SGLang's ``MemoryDriver`` (``sglang_evict.srt.cpu_driver``)
with one change, made where SGLang's scheduler would sample: before each decode step,
a request that still has forced tokens gets its last output token replaced by the
next forced one. The decode step then writes that token's K/V, and every pass of the
plugin (scoring, selection, compaction, page frees) runs exactly as in free
generation. Once the forced tokens are used up the request decodes greedily.

Why not put the forced tokens in the prompt: the prompt enters the radix tree and is
never an eviction candidate (see ``sglang_evict.quality.reference.task``).

Output layout for a request with ``F`` forced tokens and ``max_new_tokens = F + C``::

    output_ids[0 : F]      the forced tokens (each replaced the model's own prediction)
    output_ids[F : F + C]  the model's greedy continuation
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from sglang_evict.srt.cpu_driver import MemoryDriver


class TeacherForcedDriver(MemoryDriver):
    def __init__(self, *, forced: Mapping[str, Sequence[int]], **kwargs) -> None:
        super().__init__(**kwargs)
        self.forced = {rid: tuple(tokens) for rid, tokens in forced.items()}

    def prepare_decode(self, reqs: list):
        for req in reqs:
            tokens = self.forced.get(req.rid, ())
            index = len(req.output_ids) - 1  # the token this step feeds
            if index < len(tokens):
                req.output_ids[-1] = tokens[index]
        return super().prepare_decode(reqs)
