"""lm-evaluation-harness with the `flashtrain` model (train/harness.py): the harness's own command line,
`lm_eval ...` with the same arguments, after registering the model (lm-eval 0.4 finds models only in
its own registry). Needs the optional extra: `pip install -e '.[eval]'`.

    python launch/harness.py --model flashtrain --model_args checkpoint=RUN/checkpoints/step_00001000 \\
        --tasks hellaswag,arc_easy --output_path results/
    python launch/harness.py --model flashtrain --model_args checkpoint=IMPORTED,exp=flash --tasks mmlu

Datasets come through the harness (Hugging Face `datasets`); offline, point `--include_path` at task
YAMLs over local files (tests/test_trainer.py has one).
"""

from __future__ import annotations


def main() -> None:
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        from flashtrain.config.errors import ConfigError

        raise ConfigError("lm-eval is not installed: pip install -e '.[eval]' (lm-eval 0.4.x)") from None
    from lm_eval.__main__ import cli_evaluate

    import flashtrain.train.harness  # noqa: F401 - registers the `flashtrain` model

    cli_evaluate()


if __name__ == "__main__":
    from flashtrain.config.cli import exit_on_user_error

    raise SystemExit(exit_on_user_error(main))
