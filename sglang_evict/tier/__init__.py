"""The quantized tier: what a pass would evict is kept at 2-4 bits first (KIVI's
layout, OTT's outlier tokens), attended together with the full-precision pages by a
log-sum-exp merge; eviction only beyond the tier.

    module   job                                                   kind
    policy   at a pass: which of the tokens eviction would drop    pure
             enter the tier (whole groups), which wait in full
             precision, which groups the tier gives up beyond its
             bound; the bytes a request holds and can hold at most

The format, its reference quantizer and the kernels (quantize-and-pack, decode
attention with its log-sum-exp, the merge) are in ``sglang_evict_kernels``
(``tier_format``, ``tier_quant``, ``tier_attention``).
"""
