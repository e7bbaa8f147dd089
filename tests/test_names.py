"""The name lists symgrad ships as data (so that generation refuses the same names on every
machine, without importing TensorFlow) cover what the running Python and TensorFlow have."""

from __future__ import annotations

import subprocess
import sys

import pytest

from symgrad.errors import SymgradError
from symgrad.spec import PACKAGES, parse_spec, snake_case, stdlib_modules, tf_gradient_ops


def test_the_stdlib_list_covers_the_running_python():
    missing = set(sys.stdlib_module_names) - stdlib_modules()
    assert not missing, f"add to symgrad/data/stdlib_modules.txt: {sorted(missing)}"


def test_the_tf_list_covers_the_installed_tensorflow():
    """In a fresh process: the test suite itself registers gradients for its ops."""
    pytest.importorskip("tensorflow")
    script = (
        "import tensorflow\n"
        "from tensorflow.python.framework import ops\n"
        "print('\\n'.join(ops._gradient_registry.list()))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=300
    )
    registered = set(result.stdout.split())
    assert len(registered) > 300  # TensorFlow was imported fully
    missing = registered - tf_gradient_ops()
    assert not missing, f"add to symgrad/data/tf_gradient_ops.txt: {sorted(missing)}"


@pytest.mark.parametrize("file", ["stdlib_modules.txt", "tf_gradient_ops.txt"])
def test_the_lists_are_sorted_one_name_a_line(file):
    from importlib.resources import files

    lines = files("symgrad").joinpath("data", file).read_text("utf-8").splitlines()
    assert lines == sorted(set(lines)) and all(line.isidentifier() for line in lines)


def refusal(name: str) -> str:
    with pytest.raises(SymgradError) as exc:
        parse_spec(f'[ops.{name}]\nformula = "y[b] = A[b]"\n', "s.toml")
    return exc.value.render()


@pytest.mark.parametrize("name", ["Numpy", "Abc", "Os", "Sys", "Math", "Tensorflow", "Tf", "Jax"])
def test_op_names_that_shadow_a_module_are_refused(name):
    assert f"would write {snake_case(name)}.py, which shadows" in refusal(name)


@pytest.mark.parametrize("name", ["Sitecustomize", "Usercustomize", "Conftest", "Setup"])
def test_op_names_of_modules_imported_by_name_are_refused(name):
    """`site` imports sitecustomize and usercustomize at startup, pytest imports conftest,
    pip runs setup: a generated module of that name would run there."""
    assert refusal(name) == (
        f"error: s.toml [ops.{name}]: op name '{name}' would write {name.lower()}.py, which "
        "shadows the module that Python or its tools import by that name wherever its folder "
        "is on the "
        "import path; choose another name"
    )


def test_every_listed_package_is_refused_as_an_op_name():
    for module in sorted(PACKAGES):
        name = "".join(word.capitalize() for word in module.split("_"))
        assert snake_case(name) == module
        assert "which shadows a package" in refusal(name), name


@pytest.mark.parametrize("name", ["MatMul", "Softmax", "BatchMatMul", "Relu", "Sigmoid", "Exp"])
def test_tensorflow_ops_with_a_gradient_are_refused(name):
    assert refusal(name) == (
        f"error: s.toml [ops.{name}]: op name '{name}' is a TensorFlow op that already has a "
        f"gradient (registering another fails on import); name your op differently, "
        f"e.g. 'My{name}'"
    )


@pytest.mark.parametrize("name", ["BatchedMatMul", "MySoftmax", "Numpyish", "Tests", "Matmul"])
def test_near_names_are_accepted(name):
    assert parse_spec(f'[ops.{name}]\nformula = "y[b] = A[b]"\n', "s.toml").ops[0].name == name


# Op names and the Python function names TensorFlow gives them (`tf.load_op_library`).
TF_FUNCTION_NAMES = {
    "MaxPool1dK3S2": "max_pool1d_k3s2",
    "BatchedMatMul": "batched_mat_mul",
    "Conv2dSame": "conv2d_same",
    "Conv2D": "conv2d",
    "MaxPool2x2": "max_pool2x2",
    "LSTMBlockCell": "lstm_block_cell",
    "HTTPServer": "http_server",
    "MyOP": "my_op",
    "ABCDef": "abc_def",
    "A1B2C3": "a1b2c3",
    "Op_Name": "op__name",
    "Foo__Bar": "foo___bar",
    "Ab_Cd_": "ab__cd_",
    "X": "x",
    "XY": "xy",
    "XyZ": "xy_z",
    "A_b": "a_b",
    "Conv3dK3S2D2": "conv3d_k3s2d2",
    "Top2KPool": "top2k_pool",
}


@pytest.mark.parametrize(("name", "module"), sorted(TF_FUNCTION_NAMES.items()))
def test_module_names_are_tensorflows_python_function_names(name, module):
    assert snake_case(name) == module


def test_module_names_match_tensorflows_own_conversion():
    """TensorFlow's own code (the wrappers `tf.load_op_library` builds) names each op's
    Python function as `snake_case` names its module."""
    pytest.importorskip("tensorflow")
    import ast

    from tensorflow.core.framework import op_def_pb2
    from tensorflow.python.framework import _pywrap_python_op_gen

    ops = op_def_pb2.OpList()
    for name in TF_FUNCTION_NAMES:
        op = ops.op.add()
        op.name = name
        output = op.output_arg.add()
        output.name, output.type = "y", 1  # DT_FLOAT
    source = _pywrap_python_op_gen.GetPythonWrappers(ops.SerializeToString()).decode()
    functions = [
        node.name
        for node in ast.parse(source).body
        if isinstance(node, ast.FunctionDef) and not node.name.endswith("_eager_fallback")
    ]
    assert functions == [snake_case(name) for name in TF_FUNCTION_NAMES]
    assert functions == list(TF_FUNCTION_NAMES.values())


def test_check_finds_an_ops_wrapper_by_tensorflows_name_for_it():
    """`symgrad check` calls `my_ops.<snake_case(op)>`: with wrappers `ab` (op AB) and
    `a_b` (op A_b) both in a library, each op gets its own."""
    from types import SimpleNamespace

    from symgrad.check_tf import _wrapper

    def ab():
        return "AB"

    def a_b():
        return "A_b"

    wrappers = SimpleNamespace(ab=ab, a_b=a_b, max_pool1d_k3s2=ab)
    assert _wrapper(wrappers, "AB")() == "AB"
    assert _wrapper(wrappers, "A_b")() == "A_b"
    assert _wrapper(wrappers, "MaxPool1dK3S2") is ab
    with pytest.raises(SymgradError, match="no Python wrapper for op ABc"):
        _wrapper(wrappers, "ABc")  # a_bc: not in the library
