"""Pin the SGLang request payloads strop sends, read from a released wheel without importing SGLang.

strop drives SGLang through HTTP routes whose bodies are SGLang's request structs
(``python/sglang/srt/managers/io_struct.py``): a renamed field or a changed default there
changes what strop's requests mean, and SGLang silently ignores unknown body keys. This script
parses those classes and the route handlers (``http_server.py``) with ``ast`` and writes, or
checks, ``tests/serving/sglang_0_5_23_requests.json``: facts only (names, annotations, defaults).

    python scripts/check_sglang_contract.py /tmp/sglang_src --wheel /tmp/sglang_wheel/sglang-0.5.23-*.whl --write
    python scripts/check_sglang_contract.py /tmp/sglang_src [--wheel ...]   # verify; exit 1 on the first difference

The argument is the unpacked wheel (the folder holding ``sglang/`` and ``sglang-*.dist-info/``).
"""

from __future__ import annotations

import argparse
import ast
import base64
import hashlib
import json
import sys
from pathlib import Path

DEFAULT_JSON = Path(__file__).resolve().parent.parent / "tests" / "serving" / "sglang_0_5_23_requests.json"
IO_STRUCT = "python/sglang/srt/managers/io_struct.py"
HTTP_SERVER = "python/sglang/srt/entrypoints/http_server.py"

# The request classes strop's clients build, and the route each one is the body of.
ROUTES = {
    "InitWeightsUpdateGroupReqInput": "/init_weights_update_group",
    "DestroyWeightsUpdateGroupReqInput": "/destroy_weights_update_group",
    "BeginWeightUpdateReqInput": "/begin_weight_update",
    "EndWeightUpdateReqInput": "/end_weight_update",
    "UpdateWeightsFromDistributedReqInput": "/update_weights_from_distributed",
    "UpdateWeightsFromTensorReqInput": "/update_weights_from_tensor",
    "UpdateWeightFromDiskReqInput": "/update_weights_from_disk",
    "UpdateWeightVersionReqInput": "/update_weight_version",
    "PauseGenerationReqInput": "/pause_generation",
    "ContinueGenerationReqInput": "/continue_generation",
    "ReleaseMemoryOccupationReqInput": "/release_memory_occupation",
    "ResumeMemoryOccupationReqInput": "/resume_memory_occupation",
    "CheckWeightsReqInput": "/weights_checker",
    "GenerateReqInput": "/generate",
    "AbortReq": "/abort_request",
    "LoadLoRAAdapterReqInput": "/load_lora_adapter",
    "UnloadLoRAAdapterReqInput": "/unload_lora_adapter",
}
# GenerateReqInput has ~60 fields; only those strop's /generate body carries are pinned.
GENERATE_FIELDS = (
    "rid",
    "input_ids",
    "sampling_params",
    "return_logprob",
    "logprob_start_len",
    "lora_path",
    "return_routed_experts",
)
ROUTE_DECORATORS = {"get", "post", "put", "delete", "api_route"}


class ContractError(Exception):
    """The wheel or the JSON cannot be read as this script expects."""


def wheel_path(root: Path, repo_path: str) -> Path:
    """A repository path (``python/sglang/...``) as it lies in the unpacked wheel (``sglang/...``)."""
    return root / repo_path.removeprefix("python/")


def parse(root: Path, repo_path: str) -> ast.Module:
    path = wheel_path(root, repo_path)
    try:
        return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (OSError, SyntaxError) as exc:
        raise ContractError(f"cannot parse {path}: {exc}") from exc


def dist_info(root: Path) -> Path:
    found = sorted(root.glob("sglang-*.dist-info"))
    if len(found) != 1:
        raise ContractError(f"{root}: expected one sglang-*.dist-info folder, found {[p.name for p in found]}")
    return found[0]


def wheel_version(root: Path) -> str:
    for line in (dist_info(root) / "METADATA").read_text(encoding="utf-8").splitlines():
        if line.startswith("Version:"):
            return line.split(":", 1)[1].strip()
    raise ContractError(f"{dist_info(root) / 'METADATA'}: no Version line")


def check_record(root: Path, repo_paths: list[str]) -> None:
    """Each parsed file must be byte-identical to what the wheel's RECORD lists (an edited unpack is refused)."""
    record = {}
    for line in (dist_info(root) / "RECORD").read_text(encoding="utf-8").splitlines():
        name, digest, _ = line.rsplit(",", 2)
        record[name] = digest
    for repo_path in repo_paths:
        name = repo_path.removeprefix("python/")
        data = wheel_path(root, repo_path).read_bytes()
        actual = "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        if record.get(name) != actual:
            raise ContractError(f"{name}: content differs from the wheel's RECORD ({record.get(name)} != {actual})")


def field_entry(node: ast.AnnAssign, declared_in: str) -> dict:
    """One annotated class attribute: its annotation and default as source text (``field(default=...)`` unwrapped)."""
    default = None
    if node.value is not None:
        value = node.value
        is_field_call = isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "field"
        if is_field_call:
            keywords = {k.arg: k.value for k in value.keywords}
            if "default" in keywords:
                default = ast.unparse(keywords["default"])
            elif "default_factory" in keywords:
                default = f"<factory {ast.unparse(keywords['default_factory'])}>"
        else:
            default = ast.unparse(value)
    return {
        "annotation": ast.unparse(node.annotation),
        "default": default,
        "required": node.value is None,
        "declared_in": declared_in,
    }


def class_fields(classes: dict[str, ast.ClassDef], name: str) -> dict[str, dict]:
    """Fields in the order the class sees them: those of same-module base classes first (msgspec and
    dataclasses both inherit fields this way), then its own."""
    node = classes[name]
    fields: dict[str, dict] = {}
    for base in node.bases:
        if isinstance(base, ast.Name) and base.id in classes:
            fields.update(class_fields(classes, base.id))
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            if ast.unparse(stmt.annotation).startswith("ClassVar"):
                continue
            fields[stmt.target.id] = field_entry(stmt, name)
    return fields


def route_handlers(tree: ast.Module) -> dict[str, list[dict]]:
    """For every route handler: {path: [{handler, methods, body}]}, ``body`` being the parameter
    annotation that names a request class (FastAPI parses the JSON body into it)."""
    routes: dict[str, list[dict]] = {}
    for fn in tree.body:
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        params = [ast.unparse(a.annotation) for a in fn.args.args + fn.args.kwonlyargs if a.annotation is not None]
        for dec in fn.decorator_list:
            if not (
                isinstance(dec, ast.Call)
                and isinstance(dec.func, ast.Attribute)
                and isinstance(dec.func.value, ast.Name)
                and dec.func.value.id == "app"
                and dec.func.attr in ROUTE_DECORATORS
                and dec.args
                and isinstance(dec.args[0], ast.Constant)
            ):
                continue
            if dec.func.attr == "api_route":
                methods_kw = next((k.value for k in dec.keywords if k.arg == "methods"), None)
                methods = sorted(ast.literal_eval(methods_kw)) if methods_kw is not None else ["GET"]
            else:
                methods = [dec.func.attr.upper()]
            routes.setdefault(dec.args[0].value, []).append({"handler": fn.name, "methods": methods, "params": params})
    return routes


def body_param(handler: dict, cls: str) -> str | None:
    for annotation in handler["params"]:
        names = {n.id for n in ast.walk(ast.parse(annotation, mode="eval")) if isinstance(n, ast.Name)}
        if cls in names:
            return annotation
    return None


def build_contract(root: Path, wheel: Path | None) -> dict:
    if not (root / "sglang").is_dir():
        raise ContractError(f"{root}: not an unpacked SGLang wheel (no sglang/ folder)")
    check_record(root, [IO_STRUCT, HTTP_SERVER])
    io_tree, http_tree = parse(root, IO_STRUCT), parse(root, HTTP_SERVER)
    classes = {n.name: n for n in io_tree.body if isinstance(n, ast.ClassDef)}
    routes = route_handlers(http_tree)
    out = {}
    for cls, route in ROUTES.items():
        if cls not in classes:
            raise ContractError(f"{IO_STRUCT}: class {cls} not found")
        fields = class_fields(classes, cls)
        if cls == "GenerateReqInput":
            missing = [f for f in GENERATE_FIELDS if f not in fields]
            if missing:
                raise ContractError(f"{IO_STRUCT}: GenerateReqInput lacks {missing}")
            fields = {f: fields[f] for f in GENERATE_FIELDS}
        handler = next(((h, body) for h in routes.get(route, []) if (body := body_param(h, cls))), None)
        if handler is None:
            raise ContractError(f"{HTTP_SERVER}: no handler for {route} takes a {cls} body")
        out[cls] = {
            "source": IO_STRUCT,
            "route": route,
            "methods": handler[0]["methods"],
            "handler": f"{HTTP_SERVER}:{handler[0]['handler']}",
            "body": handler[1],
            "fields": fields,
        }
    return {
        "sglang_version": wheel_version(root),
        "wheel_sha256": hashlib.sha256(wheel.read_bytes()).hexdigest() if wheel else None,
        "classes": out,
    }


def first_difference(expected, actual, where: str = "") -> str | None:
    """The first place (in the wheel's order) where the JSON differs from the wheel, as a readable line."""
    if isinstance(expected, dict) and isinstance(actual, dict):
        for key in expected:
            if key not in actual:
                return f"{where}{key}: in the wheel, missing from the JSON"
            found = first_difference(expected[key], actual[key], f"{where}{key}.")
            if found:
                return found
        extra = [k for k in actual if k not in expected]
        return f"{where}{extra[0]}: in the JSON, not in the wheel" if extra else None
    if expected != actual:
        return f"{where.rstrip('.')}: JSON has {actual!r}, wheel has {expected!r}"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sglang_src", type=Path, help="the unpacked SGLang wheel")
    parser.add_argument("--wheel", type=Path, help="the .whl file itself, to record or check its sha256")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="the contract file")
    parser.add_argument("--write", action="store_true", help="write the contract instead of verifying it")
    args = parser.parse_args(argv)
    try:
        contract = build_contract(args.sglang_src, args.wheel)
        if args.write:
            args.json.write_text(json.dumps(contract, indent=1) + "\n", encoding="utf-8")
            print(f"wrote {args.json}: {len(contract['classes'])} classes from sglang {contract['sglang_version']}")
            return 0
        try:
            pinned = json.loads(args.json.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ContractError(f"cannot read {args.json}: {exc}") from exc
    except ContractError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.wheel is None:
        # Without the .whl its hash cannot be checked; the sources were checked against the RECORD.
        contract["wheel_sha256"] = pinned.get("wheel_sha256")
    diff = first_difference(contract, pinned)
    if diff:
        print(f"{args.json}: differs from {args.sglang_src}: {diff}", file=sys.stderr)
        return 1
    n_fields = sum(len(c["fields"]) for c in contract["classes"].values())
    print(
        f"ok: {len(contract['classes'])} classes, {n_fields} fields match sglang {contract['sglang_version']}"
        + ("" if args.wheel else " (wheel sha256 not checked: no --wheel)")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
