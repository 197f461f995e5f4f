"""A tool verifiers environment: arithmetic with calculator tools (an MCP server per episode)."""

import verifiers.v1 as vf

from tests.envs.vf_envs.vf_tool_tools import CalcToolset


class CalcData(vf.TaskData):
    answer: str


class CalcTaskConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()


class CalcTask(vf.Task[CalcData, vf.State, CalcTaskConfig]):
    @classmethod
    def toolsets(cls, config: CalcTaskConfig) -> list[vf.Toolset]:
        return [CalcToolset(config.tools)]

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float(trace.last_reply.strip() == self.data.answer)

    @vf.reward(weight=0.1)
    async def used_tools(self, trace: vf.Trace) -> float:
        """1 when the model called a tool."""
        return float(bool(trace.tool_messages))


class CalcConfig(vf.TasksetConfig):
    task: CalcTaskConfig = CalcTaskConfig()


class CalcTaskset(vf.Taskset[CalcTask, CalcConfig]):
    def load(self):
        for a, b in [(12, 30), (7, 8), (25, 17), (9, 14)]:
            yield CalcTask(
                CalcData(
                    prompt=f"What is {a} + {b}? Use the calc tools, then reply with the number.", answer=str(a + b)
                ),
                self.config.task,
            )


__all__ = ["CalcTaskset"]
