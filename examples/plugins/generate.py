"""Generate hooks: one sample's response, possibly in several parts.

strop train --plugins.generate=examples.plugins.generate:answer_prefix_generate
"""

from strop.types import SamplingParams, Sample

PREFIX = "The answer is"


async def answer_prefix_generate(ctx, sample: Sample, sampling: SamplingParams) -> Sample:
    """Force the response to start with a fixed prefix, then let the policy continue.

    The prefix is part of the response but not the policy's choice, so it is
    appended with ``trainable=False`` (loss mask 0, logprob 0): the loss only
    sees the tokens the engine sampled. The engine continues from prompt + prefix.
    """
    prefix_ids = ctx.tokenizer.encode(" " + PREFIX, add_special_tokens=False) if sample.response_length == 0 else []
    sample.append(prefix_ids, trainable=False, weight_version=ctx.engine.weight_version)
    completion = await ctx.engine.generate(sample.prompt_ids + sample.response_ids, sampling)
    sample.apply_completion(completion)  # appends the sampled tokens and sets the status
    sample.response_text = ctx.tokenizer.decode(sample.response_ids, skip_special_tokens=True)
    return sample
