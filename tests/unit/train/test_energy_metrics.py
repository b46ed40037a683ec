"""Energy per step in metrics.jsonl: the RAPL reader on a fake powercap tree (wrap-around included), the NVML
meter against a fake ZeusMonitor, the rows' energy fields, and absence where nothing can be measured."""

from __future__ import annotations

from types import SimpleNamespace

from plait.train.metrics import (
    EnergyMeter,
    MetricsWriter,
    NvmlEnergyMeter,
    RaplEnergyMeter,
    detect_energy_meter,
    read_metrics,
)


def _zone(root, name, energy_uj, range_uj=1_000_000):
    zone = root / name
    zone.mkdir(parents=True)
    (zone / "energy_uj").write_text(f"{energy_uj}\n")
    (zone / "max_energy_range_uj").write_text(f"{range_uj}\n")
    return zone


def test_rapl_sums_package_zones_and_handles_wrap_around(tmp_path):
    p0 = _zone(tmp_path, "intel-rapl:0", 900_000)
    p1 = _zone(tmp_path, "intel-rapl:1", 10)
    _zone(tmp_path, "intel-rapl:0:0", 5)  # a sub-zone (core) of package 0: not counted again
    meter = RaplEnergyMeter.find(tmp_path)
    assert [z.name for z in meter.zones] == ["intel-rapl:0", "intel-rapl:1"]
    assert meter.source == "rapl (2 CPU packages)"
    (p0 / "energy_uj").write_text("950000")  # +50 000 uJ
    (p1 / "energy_uj").write_text("20")  # +10
    assert meter.read_j() == 0.05001
    (p0 / "energy_uj").write_text("30000")  # wrapped at 1 000 000: +50 000 + 30 000
    assert meter.read_j() == 0.13001
    assert meter.read_j() == 0.13001  # nothing used


def test_rapl_absent_or_unreadable_gives_no_meter(tmp_path):
    assert RaplEnergyMeter.find(tmp_path / "none") is None
    assert RaplEnergyMeter.find(tmp_path) is None  # a folder without zones
    zone = tmp_path / "intel-rapl:0"
    zone.mkdir()
    (zone / "max_energy_range_uj").write_text("100")  # energy_uj missing (or root-only)
    assert RaplEnergyMeter.find(tmp_path) is None
    assert detect_energy_meter("cpu", tmp_path) is None


class FakeMonitor:
    def __init__(self, energies):
        self.gpu_indices, self.energies, self.open = [0, 1], iter(energies), []

    def begin_window(self, key):
        self.open.append(key)

    def end_window(self, key):
        assert self.open.pop() == key
        return SimpleNamespace(gpu_energy=next(self.energies))


def test_nvml_meter_sums_gpus_over_windows():
    meter = NvmlEnergyMeter(monitor=FakeMonitor([{0: 10.0, 1: 5.0}, {0: 1.5, 1: 0.5}]))
    assert meter.source == "nvml (2 GPUs)"
    assert meter.read_j() == 15.0 and meter.read_j() == 17.0
    assert meter.monitor.open == ["plait_metrics_energy"]


class CountingMeter(EnergyMeter):
    source = "fake"

    def __init__(self, readings):
        self.readings = iter(readings)

    def read_j(self):
        return next(self.readings)


def test_rows_get_energy_since_the_previous_row(tmp_path):
    w = MetricsWriter(tmp_path, tensorboard=False, energy=CountingMeter([100.0, 110.0, 130.0, 131.0, 151.0]))
    w.write({"step": 1, "loss": 2.0})  # 10 J, one step
    w.write({"step": 3, "loss": 1.0})  # 20 J over two steps (log_every = 2)
    w.write({"step": 3, "eval": {"text": 1.0}})  # validation: 1 J, no per-step value
    w.write({"step": 4, "loss": 0.5})
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [(r["energy_j"], r.get("energy_per_step_j")) for r in rows] == [(10.0, 10.0), (20.0, 10.0), (1.0, None),
                                                                           (20.0, 20.0)]
    assert {r["energy_source"] for r in rows} == {"fake"}


def test_no_meter_no_energy_fields(tmp_path):
    w = MetricsWriter(tmp_path, tensorboard=False)
    w.write({"step": 1, "loss": 2.0})
    assert not any(k.startswith("energy") for k in read_metrics(tmp_path / "metrics.jsonl")[0])
    MetricsWriter(tmp_path / "off", enabled=False, energy=CountingMeter([]))  # other ranks never read it
