"""The attention library (``mhla``) stands apart from the training harness (``mhla.training``) and the models."""
import ast
import re
import subprocess
import sys

import pytest
import torch
from helpers import ROOT

LIBRARY = sorted((ROOT / "mhla").glob("*.py"))
KERNELS = sorted((ROOT / "mhla" / "kernels").glob("*.py"))  # need triton: not imported by ``import mhla``
HEAVY = ("mhla.training", "models", "wandb", "tqdm", "torchvision.datasets", "yaml")


def imported_modules(path) -> set[str]:
    """Absolute names of what a module imports (relative imports resolved against ``mhla``)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(["mhla"] + ([base] if base else []))
            names.update([base] + [f"{base}.{alias.name}" for alias in node.names])
    return names


def test_the_library_never_imports_the_harness_or_the_models():
    assert {p.name for p in LIBRARY} >= {"attention.py", "ops.py", "naive.py", "blocks.py", "analysis.py"}
    for path in LIBRARY + KERNELS:
        bad = {name for name in imported_modules(path) if name.startswith(("mhla.training", "models"))}
        assert not bad, f"{path.name} imports {sorted(bad)}"


@pytest.mark.slow  # a fresh process
def test_importing_the_library_stays_light():
    """Nothing heavy beyond what torch itself loads (torch imports tqdm, for one)."""
    modules = ", ".join(f"mhla.{p.stem}" for p in LIBRARY if p.stem != "__init__")
    program = ("import sys, torch; before = set(sys.modules); "
               f"import mhla, {modules}; print('\\n'.join(sorted(set(sys.modules) - before)))")
    added = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, cwd=ROOT,
                           timeout=120, check=True).stdout.split()
    assert "mhla.attention" in added
    assert not [name for name in added if name.startswith(HEAVY)]


def test_the_package_declares_what_the_requirements_files_install():
    """``pip install -e .`` alone gives a working package: pyproject lists the requirements files' pins."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def pins(name):
        return [line.strip() for line in (ROOT / name).read_text().splitlines() if line.strip()]

    assert project["dependencies"] == pins("requirements.txt")
    assert project["optional-dependencies"]["dev"] == pins("requirements-dev.txt")


def test_every_requirement_is_a_tested_range_that_this_environment_satisfies():
    """Each requirement has a floor (the version CI installed when the floor was last raised) and a ceiling, and
    the versions under test lie in the range: a floor below what CI ever installs would be an untested claim."""
    from importlib.metadata import version

    from packaging.requirements import Requirement

    for name in ("requirements.txt", "requirements-dev.txt"):
        for line in filter(None, map(str.strip, (ROOT / name).read_text().splitlines())):
            requirement = Requirement(line)
            assert sorted(spec.operator for spec in requirement.specifier) == ["<", ">="], f"{name}: {line}"
            installed = version(requirement.name).split("+")[0]
            assert requirement.specifier.contains(installed), f"{name}: {line}, but {installed} is installed"


def test_cuda_marked_tests_are_skipped_without_a_device(pytester):
    pytester.makeconftest((ROOT / "tests" / "conftest.py").read_text())
    pytester.makepyfile("import pytest\n\n@pytest.mark.cuda\ndef test_on_gpu():\n    assert False\n\n\n"
                        "@pytest.mark.parametrize('device', ['cuda'])\ndef test_named_cuda(device):\n    pass\n")
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-o", "markers=cuda: needs CUDA")
    if torch.cuda.is_available():
        result.assert_outcomes(failed=1, passed=1)
    else:
        result.assert_outcomes(skipped=1, passed=1)  # an id that says "cuda" is no marker


def test_every_relative_link_in_the_documentation_resolves():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    assert len(pages) > 1
    for page in pages:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.name} links to {target}, which does not exist"


def test_ci_runs_the_readme_test_command_in_a_new_virtual_environment():
    """CI resolves what a new user resolves: the Quick start's test command, as written, in a new ``.venv``."""
    readme = (ROOT / "README.md").read_text()
    quick_start = readme.split("## Quick start", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    commands = [line for line in quick_start.splitlines() if line and not line.startswith("#")]
    assert len(commands) == 2 and commands[1].endswith("pytest -q")
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert commands[1] in ci
    assert ci.index("python -m venv --clear .venv") < ci.index("source .venv/bin/activate") < ci.index(commands[1])
    assert ".venv/" in (ROOT / ".gitignore").read_text().splitlines()


def test_every_module_of_the_library_and_the_harness_is_in_the_library_docs():
    """docs/library.md names every module of `mhla/`, `mhla/kernels/` and `mhla/training/` in its tables."""
    docs = (ROOT / "docs" / "library.md").read_text()
    modules = [*LIBRARY, *KERNELS, *sorted((ROOT / "mhla" / "training").glob("*.py"))]
    names = [str(p.relative_to(ROOT)) for p in modules if p.stem != "__init__"]
    missing = [name for name in names if f"`{name}`" not in docs]
    assert not missing, f"docs/library.md has no row for {missing}"
