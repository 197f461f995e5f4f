"""strop's harness for verifiers environments: verifiers' own bundled chat program, run with this Python.

verifiers' ``null`` harness runs the same program (``CHAT_PROGRAM_SOURCE``: a streaming chat-completions loop
that offers the task's MCP tools and runs the model's calls) through ``runtime.prepare_uv_script``, which
installs ``uv`` and builds a script environment from the network at first use. The program needs only
openai, mcp, httpx, httpx2, tenacity and certifi, which verifiers already installs here, so this harness
writes the program into the episode's runtime and runs it with ``sys.executable``: the same wire behaviour,
offline. Its arguments are those ``launch_chat_program`` passes.

The harness id is :data:`HARNESS_ID`. verifiers resolves a harness id by importing
``verifiers.v1.harnesses.<id>`` when that exists, else the top-level module ``<id>`` (a dotted id fails in
verifiers 0.4.0: its ``find_spec`` of the namespaced name raises on the missing parent package). Importing
this module registers it in ``sys.modules`` under that top-level name, so the import finds it.
"""

from __future__ import annotations

import hashlib
import json
import sys

import verifiers.v1 as vf
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE

HARNESS_ID = "strop_chat"
_SCRIPT = f"vf-chat-{hashlib.sha256(CHAT_PROGRAM_SOURCE.encode()).hexdigest()[:12]}.py"


class StropChatHarnessConfig(vf.HarnessConfig):
    """No knobs beyond verifiers' own (tool_timeout, env, ...)."""


class StropChatHarness(vf.Harness[StropChatHarnessConfig]):
    """verifiers' ``null`` harness, run with ``sys.executable`` instead of a uv script environment."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_MCP = True
    SUPPORTS_RESUME = True  # the default resume(): relaunch on the conversation so far
    SUPPORTS_TOOL_INTERCEPTION = True
    EXECUTES_CODE = False  # the program runs MCP tools only (no bash), as null's does
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url=None):
        system_prompt, prompt = self.resolve_prompt(data)
        await runtime.write(_SCRIPT, CHAT_PROGRAM_SOURCE.encode())
        # the arguments of verifiers' launch_chat_program (the secret is the interception server's, not strop's key)
        args = [f"--base-url={endpoint}", f"--api-key={secret}", f"--model={ctx.model}"]
        if tool_interception_url:
            args.append(f"--tool-interception-url={tool_interception_url}")
        if system_prompt:
            args.append(f"--system-prompt={system_prompt}")
        if mcp_urls:
            servers = {name: {"url": url, "timeout": self.config.tool_timeout} for name, url in mcp_urls.items()}
            args.append("--mcp-config=" + json.dumps({"mcpServers": servers}))
        if isinstance(prompt, str):
            args.append(f"--prompt={prompt}")
        elif prompt is not None:
            path = f".vf-initial-messages-{trace.id}.json"
            await runtime.write(path, json.dumps([message_to_wire(m) for m in prompt]).encode())
            args.append(f"--initial-messages-file={path}")
        return await runtime.run_program([sys.executable, _SCRIPT, *args], dict(self.config.resolved_env))


__all__ = ["StropChatHarness"]

sys.modules.setdefault(HARNESS_ID, sys.modules[__name__])  # verifiers' loader imports the id as a module
