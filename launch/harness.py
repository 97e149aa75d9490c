"""lm-evaluation-harness with the `flashtrain` model (train/evaluation/harness.py): the harness's own command line,
`lm_eval ...` with the same arguments, after registering the model (lm-eval 0.4 finds models only in
its own registry). Needs the optional extra: `pip install -e '.[eval]'`.

    python launch/harness.py --model flashtrain --model_args checkpoint=RUN/checkpoints/step_00001000 \\
        --tasks hellaswag,arc_easy --output_path results/
    python launch/harness.py --model flashtrain --model_args checkpoint=IMPORTED,exp=flash --tasks mmlu

Datasets come through the harness (Hugging Face `datasets`); offline, point `--include_path` at task
YAMLs over local files (tests/test_trainer.py has one).

The options are lm_eval's own (`python -m lm_eval --help` lists them all, with their defaults); those a
flashtrain run needs: `--model flashtrain`; `--model_args` comma-separated: `checkpoint=DIR` (required: a
run's checkpoints/step_XXXXXXXX, scored with the run's own config, or a weights-only import of
launch/import_official.py, which also needs `exp=NAME`), `overrides=` Hydra overrides separated by spaces
(default none; e.g. `overrides=model.use_triton=false`), `batch_size=` (default 1), `allow_damaged=true`
(score a checkpoint whose files fail their checksums, with a warning; default: refuse it); `--tasks`;
`--output_path` (default: print only). One process, the whole model; on CUDA when there is one.
"""

from __future__ import annotations


def main() -> None:
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        from flashtrain.config.errors import ConfigError

        raise ConfigError("lm-eval is not installed: pip install -e '.[eval]' (lm-eval 0.4.x)") from None
    from lm_eval.__main__ import cli_evaluate

    import flashtrain.train.evaluation.harness  # noqa: F401 - registers the `flashtrain` model

    cli_evaluate()


if __name__ == "__main__":
    import sys

    from flashtrain.config.cli import exit_on_user_error, exit_with_help

    exit_with_help(__doc__, sys.argv[1:], overrides=False)  # --help: this, before lm_eval's slow import
    raise SystemExit(exit_on_user_error(main))
