"""A test-only stand-in for vllm's ``_custom_ops`` (tests/stand_ins/README.md): SGLang
imports ``rotary_embedding`` on CPU for its CUDA path and never calls it there."""


def rotary_embedding(*args, **kwargs):
    raise RuntimeError(
        "tests/stand_ins/vllm/_custom_ops.rotary_embedding was called: the stand-in only "
        "satisfies SGLang's import on CPU, where its native rotary path runs instead"
    )
