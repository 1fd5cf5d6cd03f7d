"""The Gaudi configuration a run really trains with: logged at its start, recorded in train_results.json
(bridgetower_bench/gaudi_configuration.py), and `compare` says when two runs differ in it."""

import json

from bridgetower_bench import gaudi_configuration
from bridgetower_bench.tools import compare
from helpers import command, optimum_habana, read_json, run_script


def test_a_gaudi_run_logs_and_records_autocast_off_and_the_keys_gaudiconfig_dropped(fixtures, tmp_path):
    # A file in optimum-habana's older mixed-precision keys: GaudiConfig 1.21 drops them without a word and
    # trains in fp32. (--use_habana with --use_cpu: the Gaudi configuration is read, the run stays on the CPU.)
    config = tmp_path / "gaudi-config"
    config.mkdir()
    old_keys = {"use_habana_mixed_precision": True, "hmp_bf16_ops": ["linear"], "hmp_is_verbose": False}
    (config / "gaudi_config.json").write_text(json.dumps({**old_keys, "use_fused_clip_norm": False}))
    out = tmp_path / "run"
    args = command(fixtures, out, "gaudi", "--use_habana", "--gaudi_config_name", config, save_strategy="no")
    result = run_script("gaudi", args, env={"PT_HPU_LAZY_MODE": "0"})

    said = (
        "Gaudi configuration in effect: bf16 autocast off (fp32), fused AdamW off, fused gradient clipping off; "
        "keys GaudiConfig ignored: hmp_bf16_ops, hmp_is_verbose, use_habana_mixed_precision"
    )
    logged = result.stdout + result.stderr
    assert said in logged and logged.index(said) < logged.index("***** Running training *****")
    recorded = read_json(out / "train_results.json")
    assert {key: recorded[key] for key in gaudi_configuration.RECORD_KEYS} == {
        "gaudi_autocast": False,
        "gaudi_autocast_bf16_ops": None,
        "gaudi_autocast_fp32_ops": None,
        "gaudi_fused_adam": False,
        "gaudi_fused_clip_norm": False,
        "gaudi_config_ignored_keys": "hmp_bf16_ops, hmp_is_verbose, use_habana_mixed_precision",
    }


def test_autocast_its_op_lists_and_fused_ops_as_the_trainer_decided():
    with optimum_habana() as habana:
        clip = habana.GaudiConfig(use_torch_autocast=True, use_fused_adam=True, use_fused_clip_norm=True)
        lists = habana.GaudiConfig(
            use_torch_autocast=True, autocast_bf16_ops=["linear", "matmul"], autocast_fp32_ops=["softmax"]
        )
        one_list = habana.GaudiConfig(use_torch_autocast=True, autocast_bf16_ops=["linear"])
        file = {**clip.to_dict(), "unknown_key": 1}

        on_hpu = gaudi_configuration.effective(clip, file, autocast=True, on_hpu=True)
        on_cpu = gaudi_configuration.effective(clip, file, autocast=False, on_hpu=False)
        declared = gaudi_configuration.effective(lists, {}, autocast=True, on_hpu=True)
        undeclared = gaudi_configuration.effective(one_list, {}, autocast=True, on_hpu=True)
    assert on_hpu == {
        "gaudi_autocast": True,
        "gaudi_autocast_bf16_ops": gaudi_configuration.NOT_DECLARED,
        "gaudi_autocast_fp32_ops": gaudi_configuration.NOT_DECLARED,
        "gaudi_fused_adam": True,
        "gaudi_fused_clip_norm": True,
        "gaudi_config_ignored_keys": "unknown_key",  # (the versions GaudiConfig writes itself are known)
    }
    assert (on_cpu["gaudi_autocast"], on_cpu["gaudi_fused_adam"], on_cpu["gaudi_autocast_bf16_ops"]) == (
        False,
        False,
        None,
    )
    assert (declared["gaudi_autocast_bf16_ops"], declared["gaudi_autocast_fp32_ops"]) == ("linear, matmul", "softmax")
    # GaudiConfig declares op lists only when both are given: one alone leaves the bridge's defaults
    assert undeclared["gaudi_autocast_bf16_ops"] == gaudi_configuration.NOT_DECLARED
    assert gaudi_configuration.describe(declared) == (
        "Gaudi configuration in effect: bf16 autocast on (bf16 ops: linear, matmul; fp32 ops: softmax), fused AdamW "
        "off, fused gradient clipping off; keys GaudiConfig ignored: none"
    )


def test_compare_says_when_two_gaudi_runs_trained_with_different_gaudi_configurations(tmp_path, capsys):
    def run(name, autocast):
        record = {"train_samples_per_second": 800.0, "gaudi_autocast": autocast, "gaudi_config_ignored_keys": "none"}
        (tmp_path / name).mkdir()
        (tmp_path / name / "train_results.json").write_text(json.dumps(record))
        return str(tmp_path / name)

    bf16, fp32, cuda = run("bf16", True), run("fp32", False), str(tmp_path / "cuda")
    (tmp_path / "cuda").mkdir()
    (tmp_path / "cuda" / "train_results.json").write_text(json.dumps({"train_samples_per_second": 600.0}))
    assert compare.main([bf16, fp32]) == 0
    out = capsys.readouterr().out
    assert out.startswith(
        "**Not like for like: these runs trained with different Gaudi configurations (gaudi_autocast True / False); "
        "see each run's gaudi_* fields.**"
    )
    assert "| gaudi_autocast | True | False |" in out
    assert compare.main([bf16, bf16, cuda]) == 0  # (a run that records none, e.g. a CUDA run, is not counted)
    assert "Not like for like" not in capsys.readouterr().out
