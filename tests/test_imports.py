"""actmem never imports torch, and --help stays off the heavy imports."""

import subprocess
import sys


def run_python(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                          text=True).stdout


def test_estimator_never_imports_torch():
    out = run_python(
        "import sys\n"
        "from actmem.cli.main import cli\n"
        "for args in (['estimate', '-m', '530b'], ['estimate', '-m', '22b', '--format', 'csv'],\n"
        "             ['formulas'], ['presets']):\n"
        "    try:\n"
        "        cli(args)\n"
        "    except SystemExit as e:\n"
        "        assert e.code == 0, e.code\n"
        "print('torch' in sys.modules)\n")
    assert out.strip().splitlines()[-1] == "False"


def test_help_does_not_import_sympy_pandas_or_rich():
    out = run_python(
        "import sys\n"
        "from actmem.cli.main import cli\n"
        "for args in (['--help'], ['estimate', '--help']):\n"
        "    try:\n"
        "        cli(args)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "print(sorted(m for m in ('sympy', 'pandas', 'rich', 'torch') if m in sys.modules))\n")
    assert out.strip().splitlines()[-1] == "[]"


def test_python_dash_m_works():
    result = subprocess.run([sys.executable, "-m", "actmem", "presets", "--format", "json"],
                            capture_output=True, text=True)
    assert result.returncode == 0 and '"530b"' in result.stdout
