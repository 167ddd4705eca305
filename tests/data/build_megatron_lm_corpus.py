"""Rebuild tests/data/megatron_lm/ from a Megatron-LM git clone (not run by the tests).

    python tests/data/build_megatron_lm_corpus.py /path/to/Megatron-LM.git [core_v0.16.1]

Reads the tag's files with `git show` and writes one JSON file per launch script, model-flag file
and GPT functional-test config: {"source", "commit", "script", "argv", ...}. `argv` is what the
source passes to its training script:
- launch scripts (examples/gpt3, llama, mixtral): the script runs under bash with `torchrun`,
  `mkdir` and the `pretrain_gpt.py` existence check stubbed, positional arguments set to
  placeholder paths; argv is everything after the script name.
- model-flag files (examples/post_training/modelopt/conf/*/*.sh): `$MODEL_ARGS` split like the
  shell does.
- functional tests (tests/functional_tests/test_cases/gpt/*/model_config.yaml, and the
  mixture-of-experts ones under test_cases/moe and test_cases/mixtral, written to
  functional_tests_moe/): MODEL_ARGS turned
  into flags by the rules of tests/functional_tests/shell_test_utils/_run_training.sh (true: the
  bare flag; "": left out; a list or a "[a b]" string: its items; any other value with spaces
  or parentheses: one token),
  with the ${...} paths the CI recipe sets. The training script comes from the CI recipes
  (tests/test_utils/recipes/*/gpt*.yaml and moe*.yaml, TRAINING_SCRIPT_PATH).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

OUT = Path(__file__).resolve().parent / "megatron_lm"
CI_PATHS = {
    "DATA_PATH": "/mnt/artifacts",
    "DATA_CACHE_PATH": "/workspace/data/cache",
    "OUTPUT_PATH": "/workspace/output",
    "TENSORBOARD_PATH": "/workspace/output/tensorboard",
    "CHECKPOINT_SAVE_PATH": "/workspace/checkpoints",
    "CHECKPOINT_LOAD_PATH": "/mnt/artifacts/",
    "REPEAT": "1",  # the runner's repeat counter
}


def git(repo: str, *args: str) -> str:
    return subprocess.run(["git", "--git-dir", repo, *args], check=True, text=True,
                          capture_output=True).stdout


def files(repo: str, tag: str, under: str) -> list[str]:
    return git(repo, "ls-tree", "-r", "--name-only", tag, under).split()


def launch_script_argv(text: str) -> list[str]:
    stub = (
        'torchrun() { while [ $# -gt 0 ] && [[ "$1" != *.py ]]; do shift; done; shift; '
        'printf "%s\\0" "$@"; }\nmkdir() { :; }\n'
    )
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "pretrain_gpt.py").touch()
        script = Path(tmp, "run.sh")
        script.write_text(stub + text)
        env = {"PATH": os.environ["PATH"], "HOME": tmp}
        out = subprocess.run(["bash", str(script), "/ckpt", "/tensorboard", "/tokenizer",
                              "/data/corpus_text_document", "/merges.txt"],
                             cwd=tmp, env=env, check=True, capture_output=True).stdout
    # bash's own word splitting already happened (the arrays are expanded unquoted), so a
    # quoted item like "--split '99,1,0'" reaches Megatron-LM with its quotes: kept as is
    return [token.replace(tmp, "/workspace") for token in out.decode().split("\0")[:-1]]


def model_args_argv(text: str) -> list[str]:
    out = subprocess.run(["bash", "-c", text + '\nprintf "%s" "$MODEL_ARGS"'], check=True,
                         capture_output=True, text=True, env={"PATH": os.environ["PATH"]}).stdout
    return out.split()


class _PairsLoader(yaml.BaseLoader):
    """Keeps every scalar's text (as yq does) and duplicate keys in order."""


def _pairs(loader, node):
    pairs = []
    for k, v in node.value:
        key, value = loader.construct_object(k, deep=True), loader.construct_object(v, deep=True)
        pairs.extend(value if key == "<<" else [(key, value)])  # `<<: *ANCHOR` merges
    return pairs


_PairsLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _pairs)


def _expand(value: str) -> str:
    return re.sub(r"\$\{(\w+)\}", lambda m: CI_PATHS.get(m.group(1), m.group(0)), value)


def functional_argv(pairs) -> list[str]:
    argv: list[str] = []
    for key, value in pairs:
        if isinstance(value, list):
            argv.append(key)
            argv.extend(_expand(str(v)) for v in value)
        elif value == "true":
            argv.append(key)
        elif value == "":
            continue
        elif re.fullmatch(r"\[[^]]+\]", value):  # "[2 2]": brackets stripped, words split
            argv.append(key)
            argv.extend(_expand(value[1:-1]).split())
        else:
            argv.extend([key, _expand(value)])
    return argv


def recipe_scripts(repo: str, tag: str, model: str = "gpt") -> dict[str, str]:
    scripts: dict[str, str] = {}
    for path in files(repo, tag, "tests/test_utils/recipes"):
        recipe = yaml.safe_load(git(repo, "show", f"{tag}:{path}"))
        if not isinstance(recipe, dict) or recipe.get("spec", {}).get("model") != model:
            continue
        match = re.search(r'TRAINING_SCRIPT_PATH=\\?"?([^"\s]+(?: [^"\s]+)*)',
                          recipe["spec"]["script"])
        for product in recipe.get("products", []):
            for case in product.get("test_case", []):
                scripts.setdefault(case, match.group(1) if match else "?")
    return scripts


def write(name: str, record: dict) -> None:
    path = OUT / name
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [f" {json.dumps(k)}: {json.dumps(v)}" for k, v in record.items()]
    path.write_text("{\n" + ",\n".join(lines) + "\n}\n")


def main(repo: str, tag: str = "core_v0.16.1") -> None:
    commit = git(repo, "rev-parse", f"{tag}^{{commit}}").strip()
    for under in ("examples/gpt3", "examples/llama", "examples/mixtral"):
        for path in files(repo, tag, under):
            if path.endswith(".sh"):
                argv = launch_script_argv(git(repo, "show", f"{tag}:{path}"))
                write(f"examples/{Path(path).stem}.json",
                      {"source": path, "commit": commit, "script": "pretrain_gpt.py",
                       "argv": argv})
    for path in files(repo, tag, "examples/post_training/modelopt/conf"):
        if path.endswith(".sh") and path.count("/") == 5:
            argv = model_args_argv(git(repo, "show", f"{tag}:{path}"))
            if argv:
                write(f"modelopt_conf/{Path(path).parent.name}__{Path(path).stem}.json",
                      {"source": path, "commit": commit, "script": "(model flags)",
                       "argv": argv})
    for model, out in (("gpt", "functional_tests"), ("moe", "functional_tests_moe"),
                       ("mixtral", "functional_tests_moe")):
        functional_tests(repo, tag, commit, model, out)


def functional_tests(repo: str, tag: str, commit: str, model: str, out: str) -> None:
    scripts = recipe_scripts(repo, tag, model)
    for path in files(repo, tag, f"tests/functional_tests/test_cases/{model}"):
        if not path.endswith("/model_config.yaml"):
            continue
        config = dict(yaml.load(git(repo, "show", f"{tag}:{path}"), Loader=_PairsLoader))
        case = Path(path).parent.name
        # configs no CI recipe names at this tag run pretrain_gpt.py like the other
        # pretraining ones (MODE is set only for inference and RL)
        record = {"source": path, "commit": commit,
                  "script": scripts.get(case, "pretrain_gpt.py"),
                  "in_ci_recipe": case in scripts,
                  "mode": config.get("MODE", "pretraining"),
                  "test_type": config.get("TEST_TYPE", ""),
                  "argv": functional_argv(config["MODEL_ARGS"])}
        for extra in sorted(k for k in config if re.fullmatch(r"MODEL_ARGS_\d+", k)):
            record[f"argv_{extra[-1]}"] = functional_argv(config[extra])
        write(f"{out}/{case}.json", record)


if __name__ == "__main__":
    main(*sys.argv[1:])
