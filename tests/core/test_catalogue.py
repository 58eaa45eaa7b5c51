import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import pid_plugins
from method_cases import BUILTIN
from pid_plugins.catalogue import ModelEntry, load_catalogue, load_presets, parse_catalogue

REPO = Path(__file__).resolve().parents[2]

TIMM_TOML = """
[[model]]
name = "pid_deit_tiny_patch16_224"
base = "deit_tiny_patch16_224"
preset = "deit"
description = "DeiT-tiny with PID attention"
paper = { top1 = 73.13, fgsm = 38.52 }

[[model]]
name = "pid_deit_small_patch16_224"
base = "deit_small_patch16_224"
preset = "deit"
gains = { beta = 0.3 }
"""


def test_presets_are_read_from_the_registry():
    presets = load_presets()
    assert set(presets) == {"deit", "segmenter", "lm", "neutreno"}
    assert presets["lm"] == {"lambda_p": 0.4, "lambda_i": 0.5, "lambda_d": 0.1, "beta": 0.3}
    # every preset names where its numbers come from
    import tomllib
    from importlib import resources

    raw = tomllib.loads(resources.files("pid_plugins.registry").joinpath("presets.toml").read_text())
    assert all(table.get("source") for presets in raw.values() for table in presets.values())
    assert "NeurIPS 2023" in raw["pid"]["neutreno"]["source"]


def test_every_built_in_method_reads_its_presets_from_the_registry():
    """One preset source: registry/presets.toml holds every built-in method's presets, each with its source."""
    import tomllib
    from importlib import resources

    import pid_plugins

    raw = tomllib.loads(resources.files("pid_plugins.registry").joinpath("presets.toml").read_text())
    assert set(raw) == set(BUILTIN)
    for method, presets in raw.items():
        config_type = pid_plugins.get_method(method).config_type
        expected = {name: {k: v for k, v in table.items() if k not in ("description", "source")}
                    for name, table in presets.items()}
        assert {name: dict(fields) for name, fields in config_type.PRESETS.items()} == expected, method
        for name in presets:  # each validates as the method's config
            config_type.preset(name)


def test_parse_catalogue_entries():
    entries = parse_catalogue([("timm.toml", TIMM_TOML)])
    tiny = entries["pid_deit_tiny_patch16_224"]
    assert tiny == ModelEntry(
        name="pid_deit_tiny_patch16_224", zoo="timm", base="deit_tiny_patch16_224", preset="deit",
        description="DeiT-tiny with PID attention", paper={"top1": 73.13, "fgsm": 38.52},
    )
    assert tiny.default_config().gains == (0.8, 0.5, 0.05, 0.1)
    assert entries["pid_deit_small_patch16_224"].default_config().gains == (0.8, 0.5, 0.05, 0.3)


def test_an_entry_holds_its_methods_parameters():
    """An entry's parameters are its method's config: from its preset, or the method's default preset for the
    entry's zoo (the method's declaration), with the entry's overrides; a user's overrides go over them."""
    neutreno = pid_plugins.get_method("neutreno")
    entry = ModelEntry(name="n", zoo="hf", base="llama", method="neutreno", preset="deit", gains={"alpha": 0.3})
    assert entry.default_config() == neutreno.config_type(alpha=0.3)
    assert entry.configure({"alpha": 0.2}) == neutreno.config_type(alpha=0.2)
    assert entry.configure("lm") == neutreno.configure("lm")
    bare = ModelEntry(name="n", zoo="hf", base="llama", method="neutreno")  # no preset: the method's hf default
    assert bare.default_config() == neutreno.configure(None, "hf") and bare.default_config().alpha == 0.4
    timm_entry = ModelEntry(name="n", zoo="timm", base="deit", method="neutreno")
    assert timm_entry.default_config().alpha == 0.6
    entries = parse_catalogue([("timm.toml", TIMM_TOML.replace('preset = "deit"\ndescription',
                                                               'method = "neutreno"\ndescription', 1))])
    assert entries["pid_deit_tiny_patch16_224"].default_config() == neutreno.configure(None, "timm")
    assert load_presets("neutreno")["lm"] == {"alpha": 0.4}


@pytest.mark.parametrize(
    "file_name, text, message",
    [
        ("keras.toml", TIMM_TOML, "unknown zoo 'keras'"),
        ("timm.toml", TIMM_TOML.replace('preset = "deit"', 'preset = "imagenet"', 1),
         "model 'pid_deit_tiny_patch16_224' (attention method 'pid'): unknown PID preset 'imagenet'"),
        ("timm.toml", TIMM_TOML.replace('preset = "deit"\ndescription', 'method = "nope"\ndescription', 1),
         "unknown attention method 'nope'"),
        ("timm.toml", TIMM_TOML.replace("gains = { beta = 0.3 }", 'method = "neutreno"\ngains = { beta = 0.3 }'),
         "unknown NeuTRENOConfig field(s) ['beta']"),
        ("timm.toml", TIMM_TOML.replace("pid_deit_small", "pid_deit_tiny"), "declared twice"),
        ("timm.toml", TIMM_TOML.replace("description", "descr", 1), "unknown keys ['descr']"),
        ("timm.toml", TIMM_TOML.replace('base = "deit_tiny_patch16_224"', ""), "lacks 'base'"),
        ("timm.toml", TIMM_TOML.replace("beta = 0.3", "beta = 3.0"), "PIDConfig.beta"),
        ("timm.toml", "[models]\nname='x'\n", "unexpected top-level keys ['models']"),
    ],
)
def test_bad_catalogue_files_are_refused(file_name, text, message):
    with pytest.raises(ValueError) as info:
        parse_catalogue([(file_name, text)])
    assert message in str(info.value)


def test_list_models_and_lookup_errors(monkeypatch):
    entries = parse_catalogue([("timm.toml", TIMM_TOML)])
    monkeypatch.setattr(pid_plugins.catalogue, "load_catalogue", lambda: entries)
    assert pid_plugins.list_models() == ["pid_deit_small_patch16_224", "pid_deit_tiny_patch16_224"]
    assert pid_plugins.list_models("*tiny*") == ["pid_deit_tiny_patch16_224"]
    assert pid_plugins.list_models(zoo="hf") == []
    with pytest.raises(ValueError, match="unknown zoo 'tf'"):
        pid_plugins.list_models(zoo="tf")
    with pytest.raises(ValueError, match=r"unknown PID model 'pid_deit_tiny_patch16'.*did you mean"):
        pid_plugins.get_model_entry("pid_deit_tiny_patch16")


def test_shipped_catalogue_is_valid():
    catalogue = load_catalogue()
    for name, entry in catalogue.items():
        assert entry.name == name and entry.zoo in ("timm", "hf", "mmseg", "fairseq")
        assert isinstance(entry.default_config(), pid_plugins.get_method(entry.method).config_type)


@pytest.mark.integration
@pytest.mark.slow
def test_wheel_ships_the_registry_and_finds_it_through_importlib_resources(tmp_path, pid_plugins_wheel):
    wheel = pid_plugins_wheel  # the session's wheel (tests/conftest.py)
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "pid_plugins/registry/presets.toml" in names
    assert "pid_plugins/registry/__init__.py" in names
    assert {f"pid_plugins/registry/{p.name}" for p in (REPO / "registry").glob("*.toml")} <= names
    assert "pid_plugins/core/pid.py" in names
    assert not any(n.startswith(("tests/", "registry/")) for n in names)

    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True, cwd=tmp_path)
    code = (
        "import pid_plugins, pathlib, sys\n"
        f"assert pathlib.Path(pid_plugins.__file__).is_relative_to({str(target)!r}), pid_plugins.__file__\n"
        "print(pid_plugins.PIDConfig.preset('segmenter').gains, len(pid_plugins.list_models()))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path, capture_output=True, text=True,
                         env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"})
    assert out.stdout.startswith("(0.5, 0.3, 0.05, 1.0)")
