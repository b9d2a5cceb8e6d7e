"""The quantized tier: what a pass would evict is kept at 2-4 bits first (KIVI's
layout, OTT's outlier tokens), attended together with the full-precision pages by a
log-sum-exp merge; eviction only beyond the tier.

    module   job                                                   kind
    policy   at a pass: which of the tokens eviction would drop    pure
             enter the tier (whole groups), which wait in full
             precision, which groups the tier gives up beyond its
             bound; the bytes a request holds and can hold at most
    arena    the tier's storage: a fixed arena of group slots      stateful
             per layer, sized as a share of the KV memory; which
             request owns which slot (host), the groups' scores
    demotion a pass's demotion: the tokens it does not keep        stateful
             quantized in whole groups before the moves, written   (device)
             at their slots with the pass's commit; the groups a
             full tier gives up chosen on the device

``sglang_evict.passes.manager`` runs ``demotion`` inside a pass; the reference model
(``sglang_evict.models.reference_model.TierContext``) merges the tier's attention with the
full-precision pages'.

The format, its reference quantizer and the kernels (quantize-and-pack, decode
attention with its log-sum-exp, the merge) are in ``sglang_evict_kernels``
(``tier_format``, ``tier_quant``, ``tier_attention``).
"""
