"""Per-request eviction policy in SGLang's frontend language (``sglang.lang``).

``sgl.gen`` has no parameter for ``custom_params`` in SGLang 0.5.17, so frontend
programs use ``gen`` from here (``sgl.gen``'s arguments plus the policy fields of
``sglang_evict.request_policy``) against an ``EvictingEndpoint`` (a ``RuntimeEndpoint``
that sends them)::

    from sglang_evict.srt.frontend import EvictingEndpoint, gen

    @sgl.function
    def think_then_answer(s, question):
        s += question
        s += gen("thoughts", max_tokens=2048, kv_budget_tokens=512)   # long, bounded
        s += gen("answer", max_tokens=64, enabled=False)              # short, kept whole

    think_then_answer.run(question=..., backend=EvictingEndpoint("http://host:30000"))

``EvictingEndpoint(url, kv_policy={...})`` gives every gen of the programs it runs
those overrides (a gen's own fields win). Forks (``s.fork(n)``) share the prompt's
prefix through the server's radix cache: each branch is its own request, so each evicts
its own tokens under its own policy, and the shared prefix is never touched.

How the overrides reach the endpoint: the interpreter rebuilds each gen's sampling
parameters from a fixed list of fields (``StreamExecutor._resolve_sampling_params``),
copying each value as it is, so an extra field would be lost. The overrides therefore
ride on the gen's ``stop_token_ids`` list (``_PolicyStopIds``, a list that is sent as
the plain list it holds); ``EvictingEndpoint`` takes them off and sends them as
``custom_params["sglang_evict"]``, restoring the program's own ``stop_token_ids`` when
the gen set none. ``tests/test_frontend_policy.py`` pins this against the installed
interpreter.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from sglang.lang.api import gen as sgl_gen
from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint
from sglang.lang.ir import SglGen, SglSamplingParams

from sglang_evict.request_policy import CARRIER_KEY, FIELDS


class _PolicyStopIds(list):
    """A gen's ``stop_token_ids`` carrying its policy overrides (see the module
    docstring); ``inherited``: the gen gave no stop ids of its own."""

    def __init__(self, ids, overrides: Mapping, inherited: bool) -> None:
        super().__init__(ids)
        self.overrides = dict(overrides)
        self.inherited = inherited


@dataclasses.dataclass
class _PolicySamplingParams(SglSamplingParams):
    """Sampling parameters that send ``custom_params`` to SGLang's ``/generate``."""

    custom_params: dict | None = None

    def clone(self):
        return dataclasses.replace(self)

    def to_srt_kwargs(self):
        return {**super().to_srt_kwargs(), "custom_params": self.custom_params}


def gen(
    name: str | None = None,
    *,
    kv_budget_tokens: int | None = None,
    cadence_tokens: int | None = None,
    scorer: str | None = None,
    enabled: bool | None = None,
    **gen_kwargs,
) -> SglGen:
    """``sgl.gen(name, **gen_kwargs)`` with this gen's eviction overrides (fields left
    None come from the endpoint's ``kv_policy``, then the server). The server checks
    them: a refused value fails the program with the server's message."""
    given = dict(kv_budget_tokens=kv_budget_tokens, cadence_tokens=cadence_tokens, scorer=scorer)
    given["enabled"] = enabled
    overrides = {key: value for key, value in given.items() if value is not None}
    expr = sgl_gen(name, **gen_kwargs)
    if overrides and isinstance(expr, SglGen):  # choices=...: a select, nothing decodes
        params = expr.sampling_params
        own = params.stop_token_ids
        params.stop_token_ids = _PolicyStopIds(own or (), overrides, inherited=own is None)
    return expr


class EvictingEndpoint(RuntimeEndpoint):
    """``RuntimeEndpoint`` sending each gen's eviction overrides (``gen``) and
    ``kv_policy`` (defaults for every gen) as ``custom_params["sglang_evict"]``."""

    def __init__(self, base_url: str, *, kv_policy: Mapping | None = None, **kwargs) -> None:
        unknown = sorted(set(kv_policy or {}) - set(FIELDS))
        if unknown:
            raise ValueError(f"kv_policy has no field(s) {unknown}; allowed: {list(FIELDS)}")
        self.kv_policy = dict(kv_policy or {})
        super().__init__(base_url, **kwargs)

    def generate(self, s, sampling_params: SglSamplingParams):
        return super().generate(s, self._with_policy(s, sampling_params))

    def generate_stream(self, s, sampling_params: SglSamplingParams):
        return super().generate_stream(s, self._with_policy(s, sampling_params))

    def _with_policy(self, s, sampling_params: SglSamplingParams) -> SglSamplingParams:
        stop_ids = sampling_params.stop_token_ids
        overrides = dict(self.kv_policy)
        if isinstance(stop_ids, _PolicyStopIds):
            overrides.update(stop_ids.overrides)
            stop_ids = (
                s.default_sampling_para.stop_token_ids if stop_ids.inherited else list(stop_ids)
            )
        if not overrides:
            return sampling_params
        fields = {
            f.name: getattr(sampling_params, f.name) for f in dataclasses.fields(SglSamplingParams)
        }
        fields["stop_token_ids"] = stop_ids
        return _PolicySamplingParams(**fields, custom_params={CARRIER_KEY: overrides})
