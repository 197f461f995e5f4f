"""Prompt sources: JSONL / Parquet files and procedural reasoning-gym tasks.

Every source yields plain rows ``{"prompt", "label", "metadata"}``;
:class:`PromptSet` turns rows into token ids (applying the chat template) and
checks every prompt fits the context window before anything trains.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from strop.types import Sample


class DataError(ValueError):
    """A problem with the data, naming the file and row."""


@dataclass
class PromptRow:
    prompt: str | list[dict]
    label: Any = None
    metadata: dict = field(default_factory=dict)
    where: str = ""  # file and line (or source and row) it came from, for error messages


def _check_prompt(prompt: Any, where: str) -> str | list[dict]:
    if isinstance(prompt, str):
        if not prompt.strip():
            raise DataError(f"{where}: prompt is empty")
        return prompt
    if isinstance(prompt, list) and prompt:
        for i, m in enumerate(prompt):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise DataError(
                    f"{where}: chat message {i} must be an object with string 'role' and 'content', got {m!r}"
                )
        return prompt
    raise DataError(
        f"{where}: prompt must be a string or a non-empty list of chat messages, got {type(prompt).__name__}"
    )


def _row_from_record(record: Any, where: str, prompt_key: str, label_key: str, metadata_keys: list[str]) -> PromptRow:
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if prompt_key not in record:
        raise DataError(f"{where}: missing prompt key {prompt_key!r} (keys: {sorted(record)})")
    missing = [k for k in metadata_keys if k not in record]
    if missing:
        raise DataError(f"{where}: missing metadata keys {missing}")
    return PromptRow(
        prompt=_check_prompt(record[prompt_key], where),
        label=record.get(label_key),
        metadata={k: record[k] for k in metadata_keys},
        where=where,
    )


def read_prompt_file(
    path: str, prompt_key: str = "prompt", label_key: str = "label", metadata_keys: list[str] = ()
) -> list[PromptRow]:
    """Read a .jsonl or .parquet prompt file; a bad row fails naming the file and line."""
    p = Path(path)
    if not p.exists():
        raise DataError(f"data file {path!r} does not exist")
    if p.is_dir():
        raise DataError(f"data file {path!r} is a directory; expected a .jsonl or .parquet file")
    rows: list[PromptRow] = []
    if p.suffix == ".jsonl" or p.suffix == ".json":
        with p.open("rb") as f:
            for lineno, raw in enumerate(f, 1):
                where = f"{path}:{lineno}"
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise DataError(
                        f"{where}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at column "
                        f"{exc.start + 1}); save the file as UTF-8"
                    ) from None
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DataError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
                rows.append(_row_from_record(record, where, prompt_key, label_key, list(metadata_keys)))
    elif p.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(p)
        except Exception as exc:  # pyarrow's errors name neither the file nor what to do
            raise DataError(f"data file {path!r}: not a readable Parquet file ({type(exc).__name__}: {exc})") from None
        for i, record in enumerate(table.to_pylist()):
            rows.append(_row_from_record(record, f"{path} row {i}", prompt_key, label_key, list(metadata_keys)))
    else:
        raise DataError(f"data file {path!r}: expected a .jsonl or .parquet file")
    if not rows:
        raise DataError(f"data file {path!r} holds no rows")
    return rows


def reasoning_gym_rows(task: str, seed: int, size: int, options: dict) -> list[PromptRow]:
    """Procedural problems from reasoning-gym; the entry is kept for the task's own scorer."""
    import reasoning_gym

    try:
        dataset = reasoning_gym.create_dataset(task, seed=seed, size=size, **options)
    except Exception as exc:  # unknown task names and options surface here
        raise DataError(f"reasoning-gym task {task!r} with options {options}: {exc}") from None
    return [
        PromptRow(
            prompt=entry["question"],
            label=entry["answer"],
            metadata={"reasoning_gym_task": task, "reasoning_gym_entry": entry},
            where=f"reasoning-gym {task} seed {seed} row {i}",
        )
        for i, entry in enumerate(dataset)
    ]


def question_key(row: PromptRow, template: str, system_prompt: str | None) -> str:
    """What the model sees of a row, before tokenisation: the templated text (and system prompt)
    or the chat messages. Two rows with the same key are the same question."""
    if isinstance(row.prompt, str):
        return json.dumps([system_prompt, template.format(prompt=row.prompt)])
    return json.dumps(row.prompt, sort_keys=True)


def held_out(
    eval_rows: list[PromptRow],
    train_rows: list[PromptRow],
    *,
    template: str,
    system_prompt: str | None,
    size: int | None = None,
) -> tuple[list[PromptRow], int]:
    """The eval rows whose prompt (after templating) never occurs in the training rows, and how many
    were removed. Duplicates inside the eval set are removed too. ``size`` keeps the first ``size``."""
    seen = {question_key(r, template, system_prompt) for r in train_rows}
    kept, removed = [], 0
    for r in eval_rows:
        k = question_key(r, template, system_prompt)
        if k in seen:
            removed += 1
            continue
        seen.add(k)
        kept.append(r)
    return (kept[:size] if size else kept), removed


class PromptSet:
    """Tokenized prompts, ready to become Samples; checks every prompt fits."""

    def __init__(
        self,
        rows: list[PromptRow],
        tokenizer,
        *,
        template: str = "{prompt}",
        system_prompt: str | None = None,
        apply_chat_template: bool = True,
        max_prompt_tokens: int,
        name: str = "data",
    ):
        self.rows = rows
        self.prompt_ids: list[list[int]] = []
        for i, row in enumerate(rows):
            ids = encode_prompt(row.prompt, tokenizer, template, system_prompt, apply_chat_template)
            if len(ids) > max_prompt_tokens:
                raise DataError(
                    f"{name} row {i}: prompt has {len(ids)} tokens, more than the {max_prompt_tokens} "
                    "that fit the context window with rollout.max_new_tokens"
                )
            self.prompt_ids.append(ids)

    def __len__(self) -> int:
        return len(self.rows)

    def make_group(self, i: int, n: int, group_id: int) -> list[Sample]:
        row = self.rows[i]
        return [
            Sample(
                prompt=row.prompt,
                prompt_ids=list(self.prompt_ids[i]),
                label=row.label,
                group_id=group_id,
                index=j,
                metadata=dict(row.metadata, row_index=i),
            )
            for j in range(n)
        ]


def encode_prompt(prompt, tokenizer, template: str, system_prompt: str | None, apply_chat_template: bool) -> list[int]:
    if isinstance(prompt, str):
        text = template.format(prompt=prompt)
        if not apply_chat_template:
            return tokenizer(text, add_special_tokens=True)["input_ids"]
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages.append({"role": "user", "content": text})
    else:
        if not apply_chat_template:
            raise DataError("chat-message prompts need data.apply_chat_template=true")
        messages = prompt
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    return list(ids)


class PromptSampler:
    """Draws prompt indices epoch by epoch (shuffled by seed); its state resumes a run."""

    def __init__(self, size: int, seed: int, shuffle: bool = True):
        self.size, self.seed, self.shuffle = size, seed, shuffle
        self.epoch, self.offset, self.next_group_id = 0, 0, 0
        self._order = self._make_order()

    def _make_order(self) -> list[int]:
        order = list(range(self.size))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        return order

    def draw(self, k: int) -> list[tuple[int, int]]:
        """Return ``k`` (row index, group id) pairs, rolling into the next epoch as needed."""
        out = []
        for _ in range(k):
            if self.offset >= self.size:
                self.epoch, self.offset = self.epoch + 1, 0
                self._order = self._make_order()
            out.append((self._order[self.offset], self.next_group_id))
            self.offset += 1
            self.next_group_id += 1
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "offset": self.offset, "next_group_id": self.next_group_id}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.offset, self.next_group_id = state["epoch"], state["offset"], state["next_group_id"]
        self._order = self._make_order()
