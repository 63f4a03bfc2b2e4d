import pytest

from labkit import config


@pytest.mark.parametrize("size", config.SIZES)
def test_presets_build_and_round_trip(size):
    cfg = config.preset(size)
    assert config.RunConfig.from_dict(cfg.to_dict()) == cfg


def test_presets_grow_from_smoke_to_gpu():
    sizes = [config.preset(s).model for s in ("smoke", "lab", "gpu")]
    widths = [m.d_model * m.n_layer for m in sizes]
    assert widths == sorted(widths) and len(set(widths)) == 3


@pytest.mark.parametrize(
    ("kwargs", "field", "allowed"),
    [
        ({"n_head": 3}, "n_head", "divisor of d_model=128"),
        ({"d_model": 0}, "d_model", "positive integer"),
        ({"dropout": 1.0}, "dropout", "[0, 1)"),
    ],
)
def test_bad_model_values_name_field_value_and_rule(kwargs, field, allowed):
    with pytest.raises(ValueError) as err:
        config.ModelConfig(**kwargs)
    msg = str(err.value)
    assert msg.startswith(f"{field}={next(iter(kwargs.values()))!r}")
    assert allowed in msg


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"micro_batch": 0}, "micro_batch"),
        ({"grad_accum": 1.5}, "grad_accum"),
        ({"dtype": "fp8"}, "dtype"),
        ({"device": "tpu"}, "device"),
        ({"lr": -1.0}, "lr"),
        ({"grad_clip": 0.0}, "grad_clip"),
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"warmup_steps": 2.5}, "warmup_steps"),
        ({"min_lr": -1e-4}, "min_lr"),
        ({"min_lr": 1e-2}, "min_lr"),  # above lr=3e-3: a "decay" that would rise
    ],
)
def test_bad_train_values_raise(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}="):
        config.TrainConfig(**kwargs)


def test_unknown_preset_lists_the_allowed_sizes():
    with pytest.raises(ValueError, match=r"one of \('smoke', 'lab', 'gpu'\)"):
        config.preset("huge")


def test_replace_routes_fields_and_rejects_unknown_names():
    cfg = config.preset("smoke").replace(steps=7, n_layer=3)
    assert (cfg.train.steps, cfg.model.n_layer) == (7, 3)
    with pytest.raises(ValueError, match="unknown config field"):
        config.preset("smoke").replace(stepz=7)
    with pytest.raises(ValueError, match=r"^n_head="):
        config.preset("smoke").replace(n_head=5)


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"LABKIT_SMOKE": "1"}, r"LABKIT_SMOKE, which labkit does not read: use LABKIT_SIZE=smoke"),
        ({"LABKIT_SIZ": "smoke"}, r"did you mean LABKIT_SIZE"),
        ({"LABKIT_WHATEVER": "x"}, r"labkit reads only LABKIT_SIZE, "),
    ],
)
def test_an_unknown_labkit_variable_is_refused_with_the_fix(environ, message, monkeypatch):
    with pytest.raises(ValueError, match=message):
        config.check_environment(environ)
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match=message):
        config.preset("smoke")  # the notebooks' first call


def test_the_known_variables_pass():
    config.check_environment({"LABKIT_SIZE": "smoke", "LABKIT_HOME": "/tmp", "PATH": "/bin"})


def test_every_labkit_variable_the_project_uses_is_known():
    """A new LABKIT_* variable must be listed in config.ENVIRONMENT, or check_environment
    would refuse it."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    files = [p for pattern in ("labkit/**/*.py", "tests/*.py", "scripts/*", "benchmarks/*.py",
                               "solutions/*.ipynb", "README.md", "course", ".ci/run")
             for p in root.glob(pattern) if p.is_file()]  # fmt: skip
    used = {m for p in files for m in re.findall(r"LABKIT_[A-Z][A-Z_]*[A-Z]", p.read_text())}
    examples = {"LABKIT_SMOKE", "LABKIT_SIZ", "LABKIT_WHATEVER", "LABKIT_LAB", "LABKIT_GPU",
                "LABKIT_PRESET"}  # the refused spellings the tests and docstrings name
    assert used - examples <= set(config.ENVIRONMENT), sorted(used - examples - set(config.ENVIRONMENT))
