"""``python -m trainer.train --help``: every flag explained with its default, in groups; the help text is the
config's field comments (one source), which carry no dated measurements."""

import argparse
import dataclasses
import inspect
import re

import pytest

from trainer.config import PRESETS, TrainConfig, cli_value, field_docs, from_cli
from trainer.train import build_parser


def flags(parser):
    return [a for a in parser._actions if a.option_strings and a.help != argparse.SUPPRESS
            and not isinstance(a, argparse._HelpAction)]


def test_every_flag_has_a_help_and_its_default():
    parser = build_parser()
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    seen = set()
    for action in flags(parser):
        text = action.help or ""
        assert text.strip() and "(default" in text, (action.option_strings, text)
        if action.dest in fields:
            seen.add(action.dest)
            # the `default` preset's value, the one TrainConfig() holds
            assert f"default: {cli_value(getattr(TrainConfig(), action.dest))}" in text, (action.dest, text)
            # without help text of its own a flag would show the default only
            assert field_docs()[0][action.dest][1].replace("%", "%%") in text
    assert seen == fields - {"extra"}


def test_a_flag_names_the_presets_values_that_differ():
    text = {a.dest: a.help for a in flags(build_parser())}
    assert "default: 3072; embedded: 512, tiny: 64" in text["max_len"]
    assert "default: embedded; tiny: tiny" in text["builtin_target"]
    assert text["gamma"].endswith("(default: 7)")  # every preset has gamma 7: nothing more to say
    assert "default: 0.9,0.95" in text["betas"] and "default: off" in text["pack"]
    assert set(re.findall(r"\b(default|embedded|tiny) \(", text["preset"])) == set(PRESETS)


def test_the_flags_are_in_groups():
    parser = build_parser()
    groups = {g.title: [a.dest for a in g._group_actions] for g in parser._action_groups}
    for title in ("data", "model", "optimizer", "runtime", "run folder", "pipeline"):
        assert groups.get(title), (title, sorted(groups))
    assert {"target", "data", "max_len", "builtin_target"} <= set(groups["data"])
    assert {"num_layers", "block_size", "head_dim"} <= set(groups["model"])
    assert {"lr", "betas", "steps", "batch_size"} <= set(groups["optimizer"])
    assert {"device", "dtype", "loss", "compute_weights", "preflight"} <= set(groups["runtime"])
    assert {"out_dir", "resume", "overwrite", "allow_config_change", "log_file"} <= set(groups["run folder"])
    assert {"target_gpus", "drafter_gpus", "watchdog_s"} <= set(groups["pipeline"])


def test_help_prints_the_groups(capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "\nmodel:\n" in out and "\nrun folder:\n" in out and "--preset tiny" in out


def test_the_cli_still_sets_the_config():
    args = build_parser().parse_args(["--preset", "tiny", "--lr", "1e-3", "--betas", "0.8,0.9", "--pack",
                                      "--target-layer-ids", "1,2"])
    cfg = from_cli(args)
    assert (cfg.lr, cfg.betas, cfg.pack, cfg.target_layer_ids, cfg.builtin_target) == (1e-3, (0.8, 0.9), True,
                                                                                          [1, 2], "tiny")
    assert from_cli(build_parser().parse_args([])).max_len == PRESETS["embedded"].max_len


@dataclasses.dataclass
class _Documented:
    # a comment on the class itself, no field's
    # --- first: the first group ---
    a: int = 1  # a's own help
    # b's help, over
    # two lines
    b: str = ""
    # a stray comment, then a blank line

    c: float = 0.0
    # --- second ---
    # d's longer explanation, for readers of the code
    d: int = 2  # d's help (the trailing comment wins)


def test_field_docs_reads_the_comments():
    docs, groups = field_docs(_Documented)
    assert groups == {"first": "the first group", "second": ""}
    assert docs == {"a": ("first", "a's own help"), "b": ("first", "b's help, over two lines"), "c": ("first", ""),
                    "d": ("second", "d's help (the trailing comment wins)")}


def test_the_config_comments_carry_no_measurements():
    """House rule 12: the field comments (and so --help) say what a field does and why; the measurements
    live in benchmarks/results/."""
    src = inspect.getsource(TrainConfig)
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", src)
    assert not re.search(r"\bA/Bs?\b|\bH[12]00\b|\d ms\b", src), re.findall(r".*(?:A/B|H[12]00|\d ms).*", src)
