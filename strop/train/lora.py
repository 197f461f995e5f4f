"""LoRA (``model.lora_rank > 0``): the policy trains low-rank adapters made by the ``peft`` library, in
peft's own format, while its base weights stay frozen.

- What trains: only the adapters' A and B matrices (peft marks every other parameter frozen), so the
  optimizer's state is the adapters'.
- The KL reference: the same model with its adapters switched off (:meth:`Adapters.disabled`), no copy.
- What engines get: the merged weights ``W + (alpha / r) B A`` under the base model's own parameter names
  (:meth:`Adapters.merged_weights`), which every engine takes as a full update; the adapter alone rides
  along for strop serve (strop.sync.adapter).
- Over several processes: the adapters are added to the whole model before it is split, so data parallel
  replicates them (their gradients summed) or FSDP shards them with the base weights they adapt; merging is
  then a collective (:meth:`Adapters.merged_weights`). Context parallel splits sequences, not layers: it
  needs nothing here. Tensor parallel is refused (strop.rules).
- What is saved: the adapter as peft saves it (``adapter_config.json``, ``adapter_model.safetensors``), which
  ``peft.PeftModel.from_pretrained`` loads on the base model (:meth:`Adapters.save`).
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from strop.parallel.fsdp import full_weights
from strop.wire.lora import adapter_tensors, merge

ADAPTER = "default"  # peft's name for a model's one adapter
INITS = {"default": True, "gaussian": "gaussian"}  # model.lora_init -> peft's init_lora_weights (B zero in both)


class MergedWeights(dict):
    """The merged weights (a state dict under the base model's names) and, beside them, the adapter alone:
    ``adapter`` its tensors (strop.wire.lora's names), ``scaling`` its one scale, ``merged`` the names of the
    weights it changed."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.adapter: dict[str, torch.Tensor] = {}
        self.scaling: float | None = None
        self.merged: list[str] = []


def _peft():
    try:
        import peft
    except ImportError:
        raise ImportError(
            "model.lora_rank > 0 trains LoRA adapters with the peft library, which is not installed: "
            "pip install 'strop[lora]' (or pip install peft)"
        ) from None
    return peft


class Adapters:
    """The policy's LoRA adapters (a ``peft.PeftModel`` around the causal LM)."""

    def __init__(self, peft_model):
        self.peft = peft_model

    @property
    def model(self) -> nn.Module:
        """The causal LM with the adapters inside its linear layers (what the trainer runs and steps)."""
        return self.peft.base_model.model

    @contextmanager
    def disabled(self):
        """The base model: the adapters switched off inside the block."""
        with self.peft.disable_adapter():
            yield

    def parameters(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def _scales(self) -> dict[str, float]:
        """Each adapted linear's scale, by its base module name."""
        peft = _peft()
        return {
            name: float(m.scaling[ADAPTER])
            for name, m in self.model.named_modules()
            if isinstance(m, peft.tuners.lora.LoraLayer) and ADAPTER in m.lora_A
        }

    def sharded(self) -> bool:
        """Whether ranks hold parts of the weights (FSDP: the adapters are sharded like the base weights)."""
        return any(_is_dtensor(p) for p in self.model.parameters())

    def merged_weights(self) -> MergedWeights:
        """Every weight of the base model under its own name, each adapted linear merged (``W + scale B A``, a new
        tensor, strop.wire.lora.merge); the frozen base tensors as they are (nothing changes them). Tied tensors
        stay tied. The adapter rides along (:class:`MergedWeights`) for a transport that sends it alone.

        Over several ranks rank 0 alone gets them (it feeds the engine), the others an empty MergedWeights.
        Sharded (FSDP) it is a collective every rank calls: each tensor is gathered whole in state-dict order
        (strop.parallel.fsdp.full_weights), so rank 0 holds the whole base model once, then merges it."""
        if self.sharded():
            state = full_weights(self.model)  # fresh whole copies on rank 0, {} elsewhere
            if state:
                self._whole_adapter = {k: v for k, v in state.items() if ".lora_" in k}
                self._shards_then = [p.to_local().detach().clone() for p in self.parameters()]
        else:
            state = self.model.state_dict() if _rank() == 0 else {}
        out = MergedWeights()
        if not state:
            return out
        scales = self._scales()
        pairs = {
            name: (state[f"{name}.lora_A.{ADAPTER}.weight"], state[f"{name}.lora_B.{ADAPTER}.weight"])
            for name in scales
        }
        with torch.no_grad():
            for key in list(state):
                tensor = state.pop(key).detach()  # (gathered copies are let go as they are merged)
                if ".lora_" in key:
                    continue
                owner, _, leaf = key.rpartition(".base_layer.")
                if not owner:
                    out[key] = tensor
                elif leaf == "weight" and owner in pairs:
                    a, b = pairs[owner]
                    out[f"{owner}.weight"] = merge(tensor, a.detach(), b.detach(), scales[owner])
                    out.merged.append(f"{owner}.weight")
                else:
                    out[f"{owner}.{leaf}"] = tensor
        out.adapter = adapter_tensors(
            {name: (a.detach().clone(), b.detach().clone()) for name, (a, b) in pairs.items()}
        )
        distinct = set(scales.values())
        out.scaling = distinct.pop() if len(distinct) == 1 else None
        return out

    def describe(self, section, ref_off: bool) -> str:
        """The start line: rank, scale, targets, how many parameters train, and the reference."""
        trained = sum(p.numel() for p in self.parameters())
        total = sum(p.numel() for p in self.model.parameters())
        return (
            f"strop: LoRA rank {section.lora_rank} (alpha {section.lora_alpha:g}) on "
            f"{', '.join(section.lora_target_modules)}: {trained:,} of {total:,} parameters train"
            + ("; the KL reference is the model with its adapters off" if ref_off else "")
        )

    def save(self, path: Path) -> Path:
        """The adapter in peft's format: ``PeftModel.from_pretrained(base, path)`` loads it. Sharded (FSDP), on
        rank 0 alone: the whole adapter its last :meth:`merged_weights` gathered, refused if it changed since
        (gathering again is a collective the other ranks are not in)."""
        whole = None
        if self.sharded():
            held = getattr(self, "_whole_adapter", None)
            now = [p.to_local() for p in self.parameters()]
            then = getattr(self, "_shards_then", [])
            if held is None or len(now) != len(then) or not all(torch.equal(a, b) for a, b in zip(now, then)):
                raise RuntimeError(
                    "saving sharded LoRA adapters needs them gathered since their last update: call "
                    "merged_weights() on every rank first"
                )
            prefix = _prefix(self.peft, self.model)
            whole = {prefix + k: v for k, v in held.items()}
        self.peft.save_pretrained(str(path), state_dict=whole)
        return Path(path)


def add_adapters(
    model: nn.Module, rank: int, alpha: float, dropout: float, targets: list[str], init: str = "default"
) -> Adapters:
    """LoRA adapters of ``rank`` on the linear layers named ``targets`` of ``model`` (changed in place: its
    linears become peft's LoRA layers, its other parameters frozen). B starts at zero: the adapted model's
    outputs equal the base model's until the first optimizer step. ``init``: how A starts, peft's
    ``init_lora_weights`` ('default': True, Kaiming-uniform; 'gaussian'); the ones that move the base weights
    are refused (strop.rules)."""
    if init not in INITS:
        raise ValueError(f"model.lora_init={init!r}: strop trains LoRA adapters initialised as one of {sorted(INITS)}")
    peft = _peft()
    found = {name.rpartition(".")[2] for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    missing = sorted(set(targets) - found)
    if missing:
        raise ValueError(
            f"model.lora_target_modules: {missing} name no linear layer of this model "
            f"(its linear layers: {sorted(found)})"
        )
    config = peft.LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=list(targets),
        bias="none",
        task_type="CAUSAL_LM",
        init_lora_weights=INITS[init],
    )
    with warnings.catch_warnings():  # peft asks transformers by a name transformers 5 deprecates
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        return Adapters(peft.get_peft_model(model, config))


def _is_dtensor(t: torch.Tensor) -> bool:
    return hasattr(t, "full_tensor")


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _prefix(outer: nn.Module, inner: nn.Module) -> str:
    """The name of ``inner`` inside ``outer`` with a trailing dot (peft's ``base_model.model.``)."""
    for name, m in outer.named_modules():
        if m is inner:
            return f"{name}." if name else ""
    raise ValueError("the causal LM is not inside its peft model")
