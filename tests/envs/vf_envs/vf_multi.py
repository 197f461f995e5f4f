"""A multi-turn verifiers environment: the model names a number, the environment answers "higher" or
"lower" (or "not a number") and the model tries again, up to ``max_user_turns`` more times."""

import verifiers.v1 as vf


class GuessData(vf.TaskData):
    secret: int


class GuessTask(vf.Task[GuessData]):
    @vf.reward(weight=1.0)
    async def solved(self, trace: vf.Trace) -> float:
        return float(trace.last_reply.strip() == str(self.data.secret))

    @vf.reward(weight=0.1)
    async def short(self, trace: vf.Trace) -> float:
        """1 / (1 + characters of the last reply): a nudge toward a bare number."""
        return 1.0 / (1.0 + len(trace.last_reply))


class GuessTaskset(vf.Taskset[GuessTask, vf.TasksetConfig]):
    def load(self):
        for secret in range(1, 11):
            prompt = f"Guess my number between 1 and {secret + 3}. Reply with digits only."
            yield GuessTask(GuessData(prompt=prompt, secret=secret))


def hint(reply: str, secret: int) -> str:
    if not reply.isdigit():
        return "That is not a number. Guess again, digits only."
    return f"Wrong, go {'higher' if int(reply) < secret else 'lower'}."


class GuessEnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()
    max_user_turns: int = 2


class GuessEnv(vf.Env[GuessEnvConfig]):
    async def run(self, task, agents):
        async with agents.agent.interaction(task) as chat:
            segment = await chat.turn()
            for _ in range(self.config.max_user_turns):
                reply = segment.last_reply.strip()
                if segment.terminated or reply == str(task.data.secret):
                    break
                segment = await chat.turn(hint(reply, task.data.secret))  # the environment's turn


__all__ = ["GuessTaskset", "GuessEnv"]
