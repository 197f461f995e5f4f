"""The ``cluster`` section: where a run's processes live, this machine or a Ray cluster (strop/cluster/).
Torch-free: ``strop train --help`` reads it."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from strop.configbase import Section


class ClusterConfig(Section):
    launcher: Literal["local", "ray"] = Field(
        "local",
        description="where the processes run: 'local' (this machine: one process, or --nproc N ranks; "
        "torchrun's ranks are taken as they come) or 'ray' (trainer ranks and engines as Ray actors placed across "
        "the cluster's nodes; pip install -e '.[ray]' from a checkout; docs/scale-out.md)",
    )
    address: str | None = Field(
        None,
        description="ray: the cluster to join: 'auto' (the one started on this host with `ray start`), "
        "'host:port' (its head's GCS address), or unset: a local cluster started for this run and stopped with it",
    )
    placement: Literal["colocated", "disaggregated"] = Field(
        "disaggregated",
        description="ray: 'disaggregated' gives every engine bundles of its own (on nodes without "
        "trainer ranks where there is room); 'colocated' puts engine i in trainer rank i's bundle",
    )
    trainer_ranks: int = Field(1, ge=1, description="ray: trainer actors (the data x context parallel world size)")
    trainer_resources: dict[str, float] = Field(
        default_factory=lambda: {"CPU": 1.0},
        description="ray: what one trainer rank reserves, e.g. "
        "{CPU: 4, GPU: 1}, or fractions when colocated ({GPU: 0.4}); other keys are custom Ray resources",
    )
    engine_resources: dict[str, float] = Field(
        default_factory=lambda: {"CPU": 1.0},
        description="ray: what one engine (engine.launch=N of them) reserves, e.g. {GPU: 1} or {GPU: 0.2} colocated",
    )
    placement_timeout_s: float = Field(
        60.0,
        gt=0,
        description="ray: how long the plan may wait for its resources "
        "before the run fails naming the one that is missing",
    )
    connect_timeout_s: float = Field(10.0, gt=0, description="ray: how long reaching cluster.address may take")
    stop_timeout_s: float = Field(
        30.0,
        gt=0,
        description="ray: after a trainer rank dies, how long the others "
        "get to stop on their own before they are killed",
    )
    engine_restarts: int = Field(
        3,
        ge=0,
        description="ray: how often Ray restarts an engine actor that died (the "
        "router re-admits it once it holds the current weights)",
    )

    @field_validator("trainer_resources", "engine_resources")
    @classmethod
    def _check_resources(cls, value: dict[str, float]):
        bad = {k: v for k, v in value.items() if not v >= 0}
        if bad:
            raise ValueError(f"resource amounts must be >= 0, got {bad}")
        if value.get("GPU", 0) > 1 and value["GPU"] != int(value["GPU"]):
            raise ValueError(f"GPU={value['GPU']}: more than one GPU must be a whole number")
        return value
