"""``plexus simulate --validate``: simulated against real runs on this machine.

For P = 2, 4, 8 and seven configurations (allreduce ring and master, ps bsp and asp with one
server, D-PSGD on a ring, local SGD with H = 8, EASGD), each configuration is trained for real
(``plexus train``'s code, in this process) and simulated with the same flags and seed.

Every run, real and simulated, has the network ``--net`` (default
``bandwidth=100mbit,latency=2ms``): the real runs emulate it (``NetSpec``: a message is on
the wire bytes / bandwidth, through one card per process, and arrives latency later), the
simulator takes it as alpha and 1/beta. On loopback without it a
message costs this machine's per-message CPU work and process scheduling, not a network
(8 processes share 2 cores), which no alpha-beta model describes: ``--net none`` measures
that case anyway.

Calibration, from the real runs of two configurations: allreduce ring (its row is marked
as the calibration) and local steps (local SGD whose one averaging comes at the last step;
no row). The ring's workers' measured compute seconds per step at each P give the seconds
per sample (P processes share this machine's cores, so a sample costs more at P = 8 than
at P = 2; that is this machine's property, used for every configuration at that P). With ``--net none``,
alpha and beta are also fitted to the ring's communication time per step beyond the local
steps' (least squares over the three P). Then two times the model leaves out, at each P:

- *a step's own work*: the local steps' real time per step minus their simulated one (the
  loop, the optimizer, waiting to be scheduled among P processes on this machine's cores).
  The simulator takes it as ``ComputeModel.outside``, part of every step of every
  configuration (for D-PSGD the part after the exchange, which the gradient's overlap
  does not hide);
- *a round's work*: what the ring's real time per step exceeds its simulated one by, with
  a step's own work in (the collective's Python and its messages' handling), as
  ``ComputeModel.per_round``: paid at every step by the configurations that communicate at
  every step, by local SGD at its averagings and by EASGD at its exchanges alone.

The six configurations besides the ring are predictions. The table gives time per step
and time to the target accuracy, real against simulated, with the relative error, and
whether the configurations rank in the same order by time per step at each P.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["CONFIGS", "Row", "validate", "TOLERANCE", "VALIDATE_TAKES"]

TOLERANCE = 0.15
# The flags of ``plexus simulate`` that ``--validate`` takes; it refuses the others, which
# describe a job or a cluster it does not run.
VALIDATE_TAKES = ("steps", "net", "device", "out", "quiet")
BATCH = 64  # the global batch of every run
REFERENCE = "allreduce ring"
# The second calibration, run for real beside the seven: local SGD averaging once, at the
# last step, whose time per step is a step's own work (its period is set to the steps).
LOCAL = "local steps"
CONFIGS: dict[str, dict[str, Any]] = {
    "allreduce ring": {"strategy": "allreduce", "algorithm": "ring"},
    "allreduce master": {"strategy": "allreduce", "algorithm": "master"},
    "ps bsp": {"strategy": "ps", "consistency": "bsp"},
    "ps asp": {"strategy": "ps", "consistency": "asp"},
    "gossip ring": {"strategy": "gossip", "topology": "ring"},
    "local-sgd H=8": {"strategy": "local-sgd", "period": 8},
    "easgd": {"strategy": "easgd"},
}


@dataclass
class Row:
    workers: int
    config: str
    real_step: float
    sim_step: float
    real_ttt: float | None
    sim_ttt: float | None

    @property
    def step_error(self) -> float:
        return self.sim_step / self.real_step - 1

    @property
    def ttt_error(self) -> float | None:
        if self.real_ttt is None or self.sim_ttt is None:
            return None
        return self.sim_ttt / self.real_ttt - 1


DEFAULT_NET = "bandwidth=100mbit,latency=2ms"


def _cfg(name: str, workers: int, steps: int, target: float, out: Path, net: str | None, device: str = "auto"):
    from plexus.config import JobConfig
    spec = {"strategy": "local-sgd", "period": steps} if name == LOCAL else CONFIGS[name]
    flat = {**spec, **({"net": net} if net else {}), "device": device, "workers": workers, "steps": steps,
            "dataset": "digits", "model": "mlp", "batch_size": BATCH, "eval_every": 10, "target_accuracy": target,
            "seed": 0, "quiet": True, "out": str(out), "overwrite": True}
    return JobConfig.from_flat(flat, {k: "flag" for k in flat})


def _per_step(summary: dict) -> float:
    """Seconds per step: per worker step for asynchronous runs (each worker's own steps)."""
    steps = summary["steps"]
    if summary["steps_kind"] == "worker":
        steps = steps / summary["workers"]
    return summary["wall_seconds"] / steps


def validate(out: Path, workers: tuple[int, ...] = (2, 4, 8), steps: int = 150, target: float = 0.8,
             net: str | None = DEFAULT_NET, echo=print, device: str = "auto") -> tuple[list[Row], dict[str, float]]:
    """Train every configuration of ``CONFIGS`` and the local steps for real at each P
    (on ``device``: ``auto`` puts the workers on a GPU where torch sees one), calibrate,
    simulate; the rows and the calibration, as ``table`` prints them."""
    import io
    from plexus.config import parse_net
    from plexus.sim.cluster import ComputeModel, SimSpec, network_of
    from plexus.sim.run import simulate
    from plexus.train.job import prepare_run_dir, run_local
    real: dict[tuple[int, str], dict] = {}
    for p in workers:
        for name in [*CONFIGS, LOCAL]:
            cfg = _cfg(name, p, steps, target, out / f"real-{p}-{name.replace(' ', '_')}", net, device)
            echo(f"real      P={p} {name}")
            real[p, name] = run_local(cfg, sink=io.StringIO())[1]
    # Calibration from the reference configuration and the local steps.
    per_sample, comm = {}, {}
    for p in workers:
        s = real[p, REFERENCE]
        compute = sum(c for c in s["compute_seconds_per_worker"] if c) / p / s["steps"]
        per_sample[p] = compute / (BATCH // p)
        own = max(0.0, _per_step(real[p, LOCAL]) - compute)  # a step's own work, near enough
        comm[p] = max(0.0, s["wall_seconds"] / s["steps"] - compute - own)
    network = network_of(parse_net(net)) if net else _fit_network(comm, _gradient_bytes())

    def simulated(name: str, p: int, outside: float, per_round: float, folder: str) -> dict:
        cfg = _cfg(name, p, steps, target, out / f"{folder}-{p}-{name.replace(' ', '_')}", net)
        spec = SimSpec(workers=p, servers=cfg.cluster.servers, network=network,
                       compute=ComputeModel(per_sample=per_sample[p], outside=outside, per_round=per_round,
                                            measured=True))
        return simulate(cfg, spec, prepare_run_dir(cfg))

    outside, per_round = {}, {}
    for p in workers:
        echo(f"fitting   P={p} {LOCAL}, {REFERENCE}")
        outside[p] = max(0.0, _per_step(real[p, LOCAL]) - _per_step(simulated(LOCAL, p, 0.0, 0.0, "fit")))
        per_round[p] = max(0.0, _per_step(real[p, REFERENCE]) -
                           _per_step(simulated(REFERENCE, p, outside[p], 0.0, "fit")))
    rows = []
    for p in workers:
        for name in CONFIGS:
            echo(f"simulated P={p} {name}")
            sim = simulated(name, p, outside[p], per_round[p], "sim")
            r = real[p, name]
            rows.append(Row(p, name, _per_step(r), _per_step(sim), r["time_to_target_seconds"],
                            sim["time_to_target_seconds"]))
    return rows, {"alpha": network.alpha, "beta": network.beta,
                  **{f"per_sample_P{p}": per_sample[p] for p in workers},
                  **{f"outside_P{p}": outside[p] for p in workers},
                  **{f"per_round_P{p}": per_round[p] for p in workers}}


def _gradient_bytes() -> int:
    """Bytes of the validation model's gradient (the digits MLP, float32)."""
    from plexus.train.data import load_dataset
    from plexus.train.models import build_model
    cfg = _cfg(REFERENCE, 2, 1, 0.8, Path("."), None)
    model = build_model(cfg.model, load_dataset(cfg.data, cfg.run.seed))
    return sum(p.numel() for p in model.parameters()) * 4


def _fit_network(comm: dict[int, float], nbytes: int):
    """Alpha and beta fitted by least squares to the ring's communication time per step,
    comm[P] = 2(P-1) alpha + 2(P-1)/P N beta (``--net none``: loopback as it is)."""
    from plexus.collectives.cost import Network
    ps = sorted(comm)
    a = {p: 2 * (p - 1) for p in ps}
    b = {p: 2 * (p - 1) / p * nbytes for p in ps}
    saa = sum(a[p] ** 2 for p in ps)
    sbb = sum(b[p] ** 2 for p in ps)
    sab = sum(a[p] * b[p] for p in ps)
    sac = sum(a[p] * comm[p] for p in ps)
    sbc = sum(b[p] * comm[p] for p in ps)
    det = saa * sbb - sab ** 2
    alpha = max(1e-7, (sac * sbb - sbc * sab) / det) if det else comm[ps[0]] / a[ps[0]]
    beta = max(0.0, (saa * sbc - sab * sac) / det) if det else 0.0
    return Network(alpha=alpha, beta=beta, gamma=0.25e-9)


def table(rows: list[Row], calibration: dict[str, float]) -> str:
    def pct(x: float | None) -> str:
        return "-" if x is None else f"{x:+.0%}"

    def sec(x: float | None, digits: int = 4) -> str:
        return "-" if x is None else f"{x:.{digits}f}"
    lines = ["| P | configuration | real s/step | simulated s/step | error | real time to target s | "
             "simulated s | error |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mark = " (calibration)" if r.config == REFERENCE else ""
        lines.append(f"| {r.workers} | {r.config}{mark} | {sec(r.real_step)} | {sec(r.sim_step)} | "
                     f"{pct(r.step_error)} | {sec(r.real_ttt, 2)} | {sec(r.sim_ttt, 2)} | {pct(r.ttt_error)} |")
    within = [r for r in rows if abs(r.step_error) <= TOLERANCE]
    ttt = [r for r in rows if r.ttt_error is not None]
    ttt_within = [r for r in ttt if abs(r.ttt_error) <= TOLERANCE]
    lines.append("")
    lines.append(f"Time per step within {TOLERANCE:.0%}: {len(within)} of {len(rows)}; time to target within "
                 f"{TOLERANCE:.0%}: {len(ttt_within)} of {len(ttt)} (both reached).")
    for p in sorted({r.workers for r in rows}):
        at = [r for r in rows if r.workers == p]
        real_order = [r.config for r in sorted(at, key=lambda r: r.real_step)]
        sim_order = [r.config for r in sorted(at, key=lambda r: r.sim_step)]
        same = real_order == sim_order
        lines.append(f"P={p}: ranking by time per step {'the same' if same else 'differs'}: real "
                     f"{' < '.join(real_order)}; simulated {' < '.join(sim_order)}.")
    def ms(prefix: str) -> str:
        return ", ".join(f"{k[-2:]} {v * 1e3:.2f} ms" for k, v in calibration.items() if k.startswith(prefix))
    lines.append(f"Calibration: alpha {calibration['alpha'] * 1e6:.1f} us, 1/beta "
                 f"{(1 / calibration['beta'] / 1e9 if calibration['beta'] else math.inf):.2f} GB/s, compute per "
                 "sample " + ", ".join(f"{k[-2:]} {v * 1e6:.1f} us" for k, v in calibration.items()
                                       if k.startswith("per_sample")) +
                 f"; a step's own work {ms('outside')}; a round's work {ms('per_round')}.")
    return "\n".join(lines)
