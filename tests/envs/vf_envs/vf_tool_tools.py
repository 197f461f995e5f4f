"""The MCP tool server of vf_tool: verifiers starts it as ``python -m tests.envs.vf_envs.vf_tool_tools``."""

import verifiers.v1 as vf


class CalcToolset(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = "calc"  # offered to the model as calc_add, calc_multiply

    @vf.tool
    def add(self, a: int, b: int) -> int:
        """Add two integers and return the sum."""
        return a + b

    @vf.tool
    def multiply(self, a: int, b: int) -> int:
        """Multiply two integers and return the product."""
        return a * b


if __name__ == "__main__":
    CalcToolset.run()
