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


# --- types: every field of every config dataclass is checked against its annotation -----------


@pytest.mark.parametrize(
    ("cls", "kwargs", "message"),
    [
        (config.TrainConfig, {"lr": "3e-3"}, "lr='3e-3' is a str: give a number, e.g. lr=0.003"),
        (config.TrainConfig, {"lr": True}, "lr=True is a bool: give a number, e.g. lr=0.003"),
        (config.TrainConfig, {"lr": float("nan")}, "lr=nan is not finite: give a finite number"),
        (config.TrainConfig, {"weight_decay": float("inf")}, "weight_decay=inf is not finite"),
        (config.TrainConfig, {"adam_eps": 0.0}, "adam_eps=0.0 is not allowed"),
        (config.TrainConfig, {"device": None}, "device=None: give a str, e.g. device='auto'"),
        (config.TrainConfig, {"dtype": 16}, "dtype=16 is an int: give a str, e.g. dtype='float32'"),
        (config.TrainConfig, {"min_lr": "1e-4"},
         "min_lr='1e-4' is a str: give a number or None, e.g. min_lr=0.0003"),
        (config.TrainConfig, {"grad_clip": "off"}, "grad_clip='off' is a str: give a number or None"),
        (config.TrainConfig, {"steps": 10.0}, "steps=10.0 is a float: give an int, e.g. steps=100"),
        (config.TrainConfig, {"seed": None}, "seed=None: give an int, e.g. seed=0"),
        (config.TrainConfig, {"eval_every": False}, "eval_every=False is a bool: give an int"),
        (config.ModelConfig, {"n_layer": 2.0}, "n_layer=2.0 is a float: give an int, e.g. n_layer=4"),
        (config.ModelConfig, {"d_model": "128"}, "d_model='128' is a str: give an int"),
        (config.ModelConfig, {"dropout": None}, "dropout=None: give a number, e.g. dropout=0.0"),
        (config.ModelConfig, {"tie_weights": 1},
         "tie_weights=1 is an int: give True or False, e.g. tie_weights=True"),
        (config.RunConfig, {"model": {"n_layer": 2}},
         "model={'n_layer': 2} is a dict: give a ModelConfig, e.g. model=ModelConfig(...)"),
        (config.RunConfig, {"train": None}, "train=None: give a TrainConfig"),
    ],
)  # fmt: skip
def test_a_value_of_the_wrong_type_names_field_value_type_and_an_example(cls, kwargs, message):
    with pytest.raises(ValueError) as err:
        cls(**kwargs)
    assert str(err.value).startswith(message), str(err.value)


def test_the_type_checks_hold_for_replace_too():
    with pytest.raises(ValueError, match=r"^lr='3e-3' is a str: give a number"):
        config.preset("smoke").replace(lr="3e-3")
    with pytest.raises(ValueError, match=r"^n_layer=2.5 is a float: give an int"):
        config.preset("smoke").replace(n_layer=2.5)


def test_an_int_is_a_number_and_numpy_scalars_become_python_ones():
    import numpy as np

    t = config.TrainConfig(lr=1, weight_decay=0, grad_clip=2, min_lr=0)
    assert (t.lr, t.weight_decay, t.grad_clip, t.min_lr) == (1.0, 0.0, 2.0, 0.0)
    assert all(type(v) is float for v in (t.lr, t.weight_decay, t.grad_clip, t.min_lr))
    t = config.TrainConfig(steps=np.int64(7), lr=np.float32(0.5))  # a sweep over np.arange
    assert (t.steps, t.lr) == (7, 0.5) and type(t.steps) is int and type(t.lr) is float
    assert config.RunConfig.from_dict(config.RunConfig(train=t).to_dict()).train == t


@pytest.mark.parametrize("cls", [config.ModelConfig, config.TrainConfig, config.RunConfig])
def test_every_field_of_every_config_refuses_a_value_of_no_type_it_takes(cls):
    import dataclasses

    for f in dataclasses.fields(cls):
        with pytest.raises(ValueError, match=rf"^{f.name}=<object object at \w+> is an object: "):
            cls(**{f.name: object()})


# --- the model's vocabulary must cover the corpus's byte tokens --------------------------------


def test_a_run_whose_vocabulary_is_smaller_than_the_byte_corpus_is_refused():
    message = (r"^vocab_size=100 is too small for the corpus: it is tokenised as raw bytes "
               r"\(token ids 0\.\.255\), so vocab_size must be >= 256")  # fmt: skip
    with pytest.raises(ValueError, match=message):
        config.preset("smoke").replace(vocab_size=100)
    with pytest.raises(ValueError, match=message):
        config.RunConfig(model=config.ModelConfig(vocab_size=100))
    # A model shape alone is not trained on the corpus (exercise 01.param_count counts one).
    assert config.ModelConfig(vocab_size=100).vocab_size == 100
    assert config.preset("smoke").replace(vocab_size=512).model.vocab_size == 512
