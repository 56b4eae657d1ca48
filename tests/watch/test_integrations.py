"""The watch's integrations beyond the transformers Trainer: TensorBoard scalars (each one checked
against the record it comes from, read back from the event files by TensorBoard's own reader)
and the Lightning callback (steps, losses, validation left out, a log `attncheck watch` reads).
Both skip, visibly, where their package is not installed."""

import math

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

import attncheck
from attncheck.cli import app
from attncheck.errors import AttncheckError
from attncheck.loaders.watchlog import read_watch_log

runner = CliRunner()


class Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(16, 48)

    def forward(self, x):
        q, k, v = (z.view(2, 12, 4, 4).transpose(1, 2) for z in self.qkv(x).split(16, -1))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, 12, 16)


class TwoLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = Attention(), Attention()

    def forward(self, x):
        return self.b(self.a(x))


def _events(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_scalars_are_the_records_numbers(tmp_path):
    pytest.importorskip("tensorboard")
    torch.manual_seed(0)
    model = TwoLayers()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x = torch.randn(2, 12, 16, generator=torch.Generator().manual_seed(0)) * 3
    with attncheck.watch(model, log=tmp_path / "w.jsonl", tensorboard=tmp_path / "tb") as w:
        for _ in range(3):
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            w.step(loss=loss.item())
    events = _events(tmp_path / "tb")
    records = w.records
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        for c in r["calls"]:
            tag = "attncheck/" + c["module"]
            top = max(c["max_logit"])
            assert dict(events[tag + "/max_logit"])[r["step"]] == pytest.approx(top, rel=1e-6)
            assert dict(events[tag + "/headroom"])[r["step"]] == pytest.approx(c["limit"]["logit"] / top, rel=1e-6)
            assert dict(events[tag + "/entropy_min"])[r["step"]] == pytest.approx(min(c["entropy_min"]), rel=1e-6)
            assert dict(events[tag + "/entropy_mean"])[r["step"]] == pytest.approx(sum(c["entropy_mean"]) / 4, rel=1e-6)
            assert dict(events[tag + "/nonfinite_rows"])[r["step"]] == 0
        for g in r["grads"]:
            assert dict(events["attncheck/" + g["module"] + "/grad_max_abs"])[r["step"]] == pytest.approx(
                g["max_abs"], rel=1e-6
            )
        assert dict(events["attncheck/loss"])[r["step"]] == pytest.approx(r["loss"], rel=1e-6)
    assert [c["module"] for c in records[0]["calls"]] == ["a", "b"]


def test_a_module_called_twice_in_a_step_gets_two_series(tmp_path):
    pytest.importorskip("tensorboard")
    attn = Attention()
    model = torch.nn.Sequential()
    model.forward = lambda x: attn(attn(x))  # one module, two calls per step
    with attncheck.watch(None, tensorboard=tmp_path / "tb") as w:
        attn.train()
        model(torch.randn(2, 12, 16))
    events = _events(tmp_path / "tb")
    assert [c["module"] for c in w.records[0]["calls"]] == ["Sequential.Attention"] * 2
    assert (
        "attncheck/Sequential.Attention/max_logit" in events and "attncheck/Sequential.Attention#2/max_logit" in events
    )


def test_tensorboard_takes_the_users_writer_and_leaves_it_open(tmp_path):
    pytest.importorskip("tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(tmp_path / "tb"))
    model = TwoLayers()
    with attncheck.watch(model, tensorboard=writer):
        model(torch.randn(2, 12, 16)).sum().backward()
    writer.add_scalar("mine", 1.0, 1)  # still open
    writer.close()
    events = _events(tmp_path / "tb")
    assert "mine" in events and any(t.endswith("/max_logit") for t in events)


@pytest.mark.parametrize("value", [3, ["tb"], object()])
def test_bad_tensorboard_values_are_refused(value):
    with pytest.raises(AttncheckError, match="tensorboard"):
        attncheck.watch(None, tensorboard=value)


def test_tensorboard_folder_that_cannot_be_made_is_one_error(tmp_path):
    pytest.importorskip("tensorboard")
    (tmp_path / "file").write_text("x")
    with pytest.raises(AttncheckError, match="TensorBoard"):
        with attncheck.watch(TwoLayers(), log=tmp_path / "w.jsonl", tensorboard=tmp_path / "file" / "tb"):
            pass


@pytest.mark.filterwarnings(
    "ignore::FutureWarning", "ignore::DeprecationWarning", "ignore::UserWarning"
)  # Lightning's own, on this torch
def test_lightning_callback_writes_a_log_that_attncheck_watch_reads(tmp_path):
    L = pytest.importorskip("lightning.pytorch")
    from attncheck.integrations import LightningWatchCallback

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = TwoLayers()

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).pow(2).mean()

        def validation_step(self, batch, batch_idx):
            self.net(batch[0])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(8, 12, 16, generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=2)
    trainer = L.Trainer(
        max_steps=3,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=1,
        limit_val_batches=1,
        val_check_interval=2,
        callbacks=[LightningWatchCallback(tmp_path / "w.jsonl")],
    )
    trainer.fit(Module(), loader, loader)
    log = read_watch_log(tmp_path / "w.jsonl")
    assert [r.step for r in log.records] == [1, 2, 3]
    assert all(r.loss is not None and math.isfinite(r.loss) for r in log.records)
    assert all(len(r.calls) == 2 for r in log.records), [
        len(r.calls) for r in log.records
    ]  # validation's calls left out
    assert all(len(r.grads) == 2 for r in log.records)
    r = runner.invoke(app, ["watch", str(tmp_path / "w.jsonl"), "--fail-on", "error"])
    assert r.exit_code == 0, r.output
