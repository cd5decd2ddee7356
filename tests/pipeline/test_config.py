"""Configuration: YAML plus dotted overrides, validated before anything starts."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from asyncflow import config as cfg
from asyncflow.bench import e2e_suite
from asyncflow.train import resolve_run_dir, train, warm_starts
from asyncflow.units import parse_size
from sigterm import assert_sigterm_runs_cleanup


def test_defaults_are_the_embedded_job() -> None:
    c = cfg.load()
    assert c.model.path is None and c.data.task == "arithmetic"
    assert c.trainer.max_staleness == 1 and c.store.address == "embedded"


def test_yaml_and_dotted_overrides_compose(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("trainer:\n  lr: 0.01\n  max_steps: 9\nrollout:\n  n: 4\n")
    c = cfg.load(path, ["trainer.max_steps=3", "trainer.lr=1e-5", "run.name=exp"])
    assert (c.trainer.max_steps, c.trainer.lr, c.rollout.n, c.run.name) == (3, 1e-5, 4, "exp")


def test_a_text_setting_given_as_a_plain_yaml_number_or_boolean_is_kept_as_written(
    tmp_path: Path,
) -> None:
    # YAML reads 0755 as 493 and yes as true; numbers for numeric settings stay numbers.
    path = tmp_path / "c.yaml"
    path.write_text(
        "run:\n  name: 0755\n  output_dir: 1e3\ndata:\n  system_prompt: yes\n"
        "  eval_size: 0x10\ntrainer:\n  lr: 1e-3\nstore:\n  memory_limit: 4_000_000_000\n"
        "rollout:\n  kv_cache_memory: 0x4000000\n"
    )
    c = cfg.load(path)
    assert (c.run.name, c.run.output_dir, c.data.system_prompt) == ("0755", "1e3", "yes")
    assert (c.data.eval_size, c.trainer.lr) == (16, 1e-3)
    # Sizes as YAML spells integers still read as the numbers they are.
    assert (parse_size(c.store.memory_limit), parse_size(c.rollout.kv_cache_memory)) == (
        4_000_000_000,
        1 << 26,
    )


@pytest.mark.parametrize("name", ["", " ", ".", "..", "../x", "a/../../x", "/abs"])
def test_a_run_name_that_leaves_the_output_directory_is_refused(name: str) -> None:
    # Empty put the run beside run.output_dir (runs-2), '..' outside it.
    config = cfg.load(None, [f"run.name='{name}'"])
    with pytest.raises(cfg.ConfigError, match=r"must name a directory inside run\.output_dir"):
        resolve_run_dir(config, None)


def test_a_run_name_may_name_nested_directories(tmp_path: Path) -> None:
    config = cfg.load(None, ["run.name=exp/1", f"run.output_dir={tmp_path}"])
    assert resolve_run_dir(config, None) == tmp_path / "exp" / "1"
    (tmp_path / "exp" / "1").mkdir(parents=True)
    assert resolve_run_dir(config, None) == tmp_path / "exp" / "1-2"
    # Not used when the run directory is given.
    assert resolve_run_dir(cfg.load(None, ["run.name=.."]), tmp_path / "r") == tmp_path / "r"


def test_a_leading_tilde_in_a_path_setting_is_the_home_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Quoted, or in YAML, no shell expands it: ~/runs became a directory named "~" here.
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  path: ~/model\n")
    c = cfg.load(path, ["run.output_dir=~/runs", "run.name=~x"])
    assert c.model.path == str(tmp_path / "model")
    assert c.run.output_dir == str(tmp_path / "runs")
    assert c.run.name == "~x"  # not a path: as written
    with pytest.raises(cfg.ConfigError, match="no home directory for ~nosuchuser"):
        cfg.load(None, ["run.output_dir=~nosuchuser/runs"])


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (["trainer.lrr=1"], "did you mean trainer.lr"),
        (["nosuch.key=1"], "unknown config key nosuch"),
        (["trainer.max_steps=three"], "trainer.max_steps must be an integer"),
        (["trainer.max_steps=0"], "trainer.max_steps must be at least 1"),
        (["trainer.lr=-1"], "trainer.lr must be a positive number"),
        # Each of these was accepted, and the run failed later with a traceback.
        (["trainer.lr=inf"], "trainer.lr must be a positive number"),
        (["trainer.weight_decay=-1"], "trainer.weight_decay must be a number >= 0"),
        (["run.stall_timeout=-1"], "run.stall_timeout must be positive"),
        (["warm_start.batch_size=0"], "warm_start.batch_size must be at least 1"),
        (["store.memory_limit=4GB_"], "store.memory_limit"),
        (["store.address=foo"], "store.address must be embedded or"),
        # Silently ignored: the built-in task trained instead.
        (["data.train_file=/no/file.parquet"], "read only by a task of files"),
        (["rollout.n=1"], "rollout.n must be at least 2"),
        (["trainer.correction=magic"], "trainer.correction must be one of"),
        (["trainer.kl_coef=0.1"], "needs algorithm.reference"),
        (["model.hidden_size=100", "model.heads=3"], "multiple of model.heads"),
        (["model.path=/no/such/model"], "is not a directory"),
        (["data.task=parquet"], "needs data.train_file"),
        (["data.task=parquet", "data.train_file=/no/file.parquet"], "does not exist"),
        (["run.seed"], "not of the form"),
        (["trainer.groups_per_step=5", "trainer.dp_size=2"], "multiple of trainer.dp_size"),
        (["rollout.kv_cache_memory=lots"], "rollout.kv_cache_memory"),
        (["rollout.kv_cache_memory=0"], "rollout.kv_cache_memory must be a positive size"),
        (["trainer.lr_schedule=linear"], "trainer.lr_schedule must be one of"),
        (["trainer.min_lr_ratio=2"], "trainer.min_lr_ratio must be in"),
        (["trainer.timeout=0"], "trainer.timeout must be positive"),
        # Zero stopped learning and a negative norm turned the update around (hf, fsdp).
        (["trainer.grad_clip=0"], "trainer.grad_clip must be positive"),
        (["trainer.grad_clip=-1"], "trainer.grad_clip must be positive"),
        (["algorithm.max_extra_groups=2"], "needs filter_groups: true"),
        (
            ["reward.type=http", "reward.http.url=http://x:9", "reward.http.template=S {r}"],
            r"reward.http.template must contain \{response\}",
        ),
    ],
)
def test_bad_settings_are_rejected_with_the_key_named(override: list[str], message: str) -> None:
    with pytest.raises(cfg.ConfigError, match=message):
        cfg.load(None, override)


def test_a_section_given_twice_in_a_file_is_refused(tmp_path: Path) -> None:
    # The second silently replaced the first, settings and all.
    path = tmp_path / "c.yaml"
    path.write_text("trainer:\n  max_steps: 10\nrollout:\n  n: 4\ntrainer:\n  lr: 0.5\n")
    with pytest.raises(cfg.ConfigError, match="'trainer' is given twice"):
        cfg.load(path)
    path.write_text("trainer:\n  max_steps: 10\n  max_steps: 11\n")
    with pytest.raises(cfg.ConfigError, match="'max_steps' is given twice"):
        cfg.load(path)


def test_a_config_file_that_is_not_text_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_bytes(b"trainer:\n  max_steps: \xff\xfe\n")
    with pytest.raises(cfg.ConfigError, match="cannot read"):
        cfg.load(path)


def test_the_store_token_is_not_written_with_the_settings() -> None:
    c = cfg.load(None, ["store.address=tcp://127.0.0.1:7391", "store.token=sekrit123"])
    assert c.store.token == "sekrit123"
    assert "sekrit123" not in c.to_yaml() and c.shareable()["store"]["token"] is None


@pytest.mark.parametrize("override", ["rollout.engine=vlm", "trainer.engine=deepspeeed"])
def test_an_unknown_engine_is_refused_before_the_run_starts(tmp_path: Path, override: str) -> None:
    # It failed when the engines were made: after the warm start (minutes), in a run directory
    # left behind.
    with pytest.raises(cfg.ConfigError, match=r"unknown (rollout|train) engine .*; known: .*hf"):
        train(cfg.load(None, [override]), run_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_ranks_of_an_engine_that_cannot_run_as_ranks_are_refused_before_the_run_starts(
    tmp_path: Path,
) -> None:
    # It was refused when the engines were made, after the warm start.
    with pytest.raises(cfg.ConfigError, match=r"dp_size > 1 needs trainer.engine deepspeed"):
        train(cfg.load(None, ["trainer.dp_size=2", "trainer.engine=hf"]), run_dir=tmp_path / "r")
    assert not (tmp_path / "r").exists()


def test_a_missing_config_file_is_reported() -> None:
    with pytest.raises(cfg.ConfigError, match="does not exist"):
        cfg.load("/no/such.yaml")


def test_a_config_file_or_override_that_is_not_yaml_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "bad.yaml").write_text("trainer: {lr: [1,\n")
    with pytest.raises(cfg.ConfigError, match=r"bad\.yaml is not valid YAML"):
        cfg.load(tmp_path / "bad.yaml")
    with pytest.raises(cfg.ConfigError, match=r"override trainer\.lr='\[1,': not a YAML value"):
        cfg.load(None, ["trainer.lr=[1,"])


def test_a_text_settings_override_is_taken_as_written(tmp_path: Path) -> None:
    c = cfg.load(
        None,
        [
            "data.system_prompt=End your answer with #### and the number",  # YAML: a comment
            "reward.type=http",
            "reward.http.url=http://127.0.0.1:9",
            "reward.http.template=Q: {prompt} A: {response}",  # YAML: a mapping
            "reward.model.template='{response} #quoted'",
        ],
    )
    assert c.data.system_prompt == "End your answer with #### and the number"
    assert c.reward.http.template == "Q: {prompt} A: {response}"
    assert c.reward.model.template == "{response} #quoted"
    assert cfg.load(None, ["data.system_prompt=null"]).data.system_prompt is None


def test_a_reward_model_template_without_the_response_is_refused(tmp_path: Path) -> None:
    with pytest.raises(cfg.ConfigError, match=r"reward.model.template must contain \{response\}"):
        cfg.load(
            None,
            ["reward.type=model", f"reward.model.path={tmp_path}", "reward.model.template={r}"],
        )


def test_the_resolved_config_round_trips_through_yaml_but_for_the_token(tmp_path: Path) -> None:
    c = cfg.load(None, ["trainer.max_steps=7", "store.token=abc"])
    path = tmp_path / "resolved.yaml"
    path.write_text(c.to_yaml())
    assert cfg.load(path) == dataclasses.replace(c, store=dataclasses.replace(c.store, token=None))


EXAMPLES = Path(__file__).parents[2] / "examples"


def test_the_arithmetic_example_is_valid() -> None:
    assert cfg.load(EXAMPLES / "arithmetic.yaml").run.name == "arithmetic"


def test_the_long_tail_example_is_the_e2e_suites_long_tail_job() -> None:
    example = cfg.load(EXAMPLES / "longtail.yaml")
    overrides = ["run.name=longtail", "data.eval_size=200", "trainer.max_steps=30"]
    assert example == cfg.load(None, [*e2e_suite.LONGTAIL, *overrides])


def test_the_tools_example_is_the_e2e_suites_tools_job() -> None:
    example = cfg.load(EXAMPLES / "tools.yaml")
    overrides = [
        "run.name=tools",
        "run.eval_every=10",
        "data.eval_size=200",
        "trainer.max_steps=40",
    ]
    assert example == cfg.load(None, [*e2e_suite.TOOLS, *overrides])


def existing_paths(tmp_path: Path) -> list[str]:
    """Overrides pointing an example's model and data paths at files that exist (empty)."""
    (tmp_path / "model").mkdir()
    for name in ("train.parquet", "test.parquet"):
        (tmp_path / name).write_bytes(b"")
    return [
        f"model.path={tmp_path / 'model'}",
        f"data.train_file={tmp_path / 'train.parquet'}",
        f"data.eval_file={tmp_path / 'test.parquet'}",
    ]


def test_the_parquet_example_is_valid_once_its_paths_exist(tmp_path: Path) -> None:
    assert cfg.load(EXAMPLES / "parquet.yaml", existing_paths(tmp_path)).data.task == "dataset"


def test_the_two_node_ray_example_is_valid_once_its_paths_exist(tmp_path: Path) -> None:
    c = cfg.load(EXAMPLES / "ray-2x8gpu.yaml", existing_paths(tmp_path))
    assert (c.launcher, c.trainer.dp_size, c.rollout.engines) == ("ray", 8, 8)
    assert (c.ray.trainer_gpus, c.ray.rollout_gpus) == (1.0, 1.0)


def test_a_negative_ray_resource_is_a_config_error() -> None:
    with pytest.raises(cfg.ConfigError, match=r"ray\.rollout_gpus cannot be negative"):
        cfg.load(None, ["ray.rollout_gpus=-1"])


def test_off_is_a_word_where_a_setting_takes_words(tmp_path: Path) -> None:
    # YAML reads an unquoted off as false: a setting whose choices are words gets the word back.
    assert cfg.load(None, ["rollout.partial=continue", "rollout.partial=off"]).rollout.partial == (
        "off"
    )
    (tmp_path / "c.yaml").write_text("rollout:\n  partial: off\n")
    assert cfg.load(tmp_path / "c.yaml").rollout.partial == "off"
    with pytest.raises(cfg.ConfigError, match="must be one of"):
        cfg.load(None, ["rollout.partial=on"])


def test_chat_template_takes_auto_true_or_false() -> None:
    assert cfg.load(None, []).data.chat_template == "auto"
    assert cfg.load(None, ["data.chat_template=false"]).data.chat_template is False
    assert cfg.load(None, ["data.chat_template=true"]).data.chat_template is True
    with pytest.raises(
        cfg.ConfigError, match=r"chat_template must be true or false or one of \[.auto.\]"
    ):
        cfg.load(None, ["data.chat_template=sometimes"])


def test_extra_keys_are_a_list_of_paths() -> None:
    c = cfg.load(None, ["data.extra_keys=[extra_info.index, data_source]"])
    assert c.data.extra_keys == ["extra_info.index", "data_source"]
    with pytest.raises(cfg.ConfigError, match=r"data\.extra_keys must be a list"):
        cfg.load(None, ["data.extra_keys=extra_info.index"])


def test_a_micro_batch_must_hold_the_longest_sample() -> None:
    with pytest.raises(cfg.ConfigError, match=r"trainer\.micro_batch_tokens \(512\) must hold"):
        cfg.load(
            None,
            [
                "data.max_prompt_length=600",
                "rollout.max_tokens=8",
                "trainer.micro_batch_tokens=512",
            ],
        )


def test_the_gsm_synthetic_example_is_valid_once_its_data_is_made(tmp_path: Path) -> None:
    for name in ("train.parquet", "test.parquet"):
        (tmp_path / name).write_bytes(b"")
    overrides = [
        f"data.train_file={tmp_path / 'train.parquet'}",
        f"data.eval_file={tmp_path / 'test.parquet'}",
    ]
    c = cfg.load(EXAMPLES / "gsm-synthetic.yaml", overrides)
    assert (c.model.path, c.reward.fn, c.data.demonstration_key) == (
        None,
        "gsm8k",
        "extra_info.solution",
    )


@pytest.mark.parametrize(
    ("overrides", "warm"),
    [
        ([], True),
        (["model.path=MINE"], False),
        (["model.path=MINE", "warm_start.enabled=true"], True),
        (["warm_start.enabled=false"], False),
    ],
)
def test_the_warm_start_is_for_the_built_in_model_unless_asked(
    overrides: list[str], warm: bool, tmp_path: Path
) -> None:
    """Its demonstrations are the built-in task's bare answers: a model of one's own is not
    fine-tuned on them unless the config says so."""
    overrides = [o.replace("MINE", str(tmp_path)) for o in overrides]
    assert warm_starts(cfg.load(None, overrides)) is warm


def test_a_fresh_run_in_a_directory_that_holds_a_run_is_refused(tmp_path: Path) -> None:
    """It would have mixed its outputs with the other run's and thrown its checkpoints away; a
    run that stopped before training is no such run, unless its model or warm start differ."""
    config = cfg.load(None, [])
    (tmp_path / "config.yaml").write_text(config.to_yaml())
    with pytest.raises(cfg.ConfigError, match=r"start of a run with model.hidden_size"):
        train(cfg.load(None, ["model.hidden_size=48"]), run_dir=tmp_path)
    (tmp_path / "ledger.jsonl").write_text('{"step": 0, "trained": [0]}\n')
    with pytest.raises(cfg.ConfigError, match="holds a run already"):
        train(config, run_dir=tmp_path)


@pytest.mark.parametrize(
    "change",
    [
        "rollout.n=4",
        "trainer.groups_per_step=4",
        "run.seed=3",
        "data.digits=3",
        "trainer.ppo_epochs=2",  # the schedule counts optimiser steps: it would jump
        "warm_start.steps=7",  # the warm start made is kept
        "trainer.engine=hf",  # it failed only once the engine had started, reading its state
    ],
)
def test_a_resume_that_changes_what_the_checkpoint_means_is_refused(
    tmp_path: Path, change: str
) -> None:
    (tmp_path / "config.yaml").write_text(cfg.load(None, []).to_yaml())
    key = change.split("=", maxsplit=1)[0]
    with pytest.raises(cfg.ConfigError, match=rf"{key} changed"):
        train(cfg.load(tmp_path / "config.yaml", [change]), resume=tmp_path)
    saved = cfg.load(tmp_path / "config.yaml", [])
    with pytest.raises(cfg.ConfigError, match="stays in its directory"):
        train(saved, run_dir=tmp_path / "elsewhere", resume=tmp_path)


def test_a_resume_with_max_steps_below_its_checkpoint_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text(cfg.load(None, []).to_yaml())
    (tmp_path / "checkpoints" / "step-000004").mkdir(parents=True)
    with pytest.raises(cfg.ConfigError, match=r"max_steps 2: its checkpoint step-000004 is past"):
        train(cfg.load(tmp_path / "config.yaml", ["trainer.max_steps=2"]), resume=tmp_path)


def test_sigterm_stops_the_train_command_through_its_cleanup() -> None:
    """As Ctrl-C does: what the job started is stopped on the way out (exit status 143)."""
    script = (
        "import os, signal, sys, time\n"
        "from asyncflow import cli\n"
        "cli._stop_on_sigterm()\n"
        "try:\n"
        "    print('ready', flush=True)\n"
        "    while True: time.sleep(0.1)\n"
        "finally:\n"
        "    print('cleaned up', flush=True)\n"
    )
    assert_sigterm_runs_cleanup(script)
