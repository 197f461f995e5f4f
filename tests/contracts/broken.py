"""Plugins that break their contracts in one way each (for the checker's tests)."""


def reward_wrong_name(s):
    return 1.0


def reward_two_params(sample, label):
    return 1.0


def reward_returns_text(sample):
    return "correct"


def generate_sync(ctx, sample, sampling):
    return sample


async def generate_breaks_invariants(ctx, sample, sampling):
    sample.response_ids.append(5)  # no logprob, no mask entry
    return sample


async def generate_forgets_status(ctx, sample, sampling):
    completion = await ctx.engine.generate(sample.prompt_ids, sampling)
    sample.append(completion.token_ids, completion.logprobs)
    return sample


async def filter_async(group):
    return True


def filter_returns_int(group):
    return 1


def advantage_wrong_shape(rewards, group_ids, mask):
    return rewards[:1]


def loss_without_info(logprobs, old_logprobs, advantages, mask):
    return -advantages * logprobs


def postprocess_positional_only(samples, step, /):
    return None


NOT_CALLABLE = 42


def tools_not_tools(config):
    return [{"name": "search", "fn": print}]


def tools_duplicate_names(config):
    from strop.tools import CALCULATOR

    return [CALCULATOR, CALCULATOR]


def tools_schema_mismatch(config):
    from strop.tools import Tool

    def lookup(key):
        return key

    return [
        Tool(
            "lookup",
            "Look a key up.",
            {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
            lookup,
        )
    ]


def tools_returns_none(config):
    from strop.tools import Tool

    def shout(text):
        print(text.upper())  # prints instead of returning: the model would read "None"

    return [
        Tool("shout", "Upper-case the text.", {"type": "object", "properties": {"text": {"type": "string"}}}, shout)
    ]


def agent_returns_text(base_url, api_key, row):
    import openai

    openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0).chat.completions.create(
        model="m", messages=row["messages"]
    )
    return "well done"


def agent_wrong_params(url, key, row):
    return 1.0


def agent_makes_no_call(base_url, api_key, row):
    return 1.0
