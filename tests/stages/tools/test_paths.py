"""stages.tools.paths: tools named by import path resolve to their functions, and every bad path says why."""
import pytest

from stages.builtin import arithmetic_tools
from stages.tools.paths import resolve_tool, split_path, tool_problems


def test_both_path_forms_name_the_same_function():
    assert split_path("stages.builtin.arithmetic_tools.add") == ("stages.builtin.arithmetic_tools", "add")
    assert split_path("stages.builtin.arithmetic_tools:add") == ("stages.builtin.arithmetic_tools", "add")
    assert resolve_tool(arithmetic_tools.TOOL_PATH) is arithmetic_tools.add
    assert resolve_tool("stages.builtin.arithmetic_tools:add") is arithmetic_tools.add


@pytest.mark.parametrize("path, why", [
    ("add", "expected an import path"),
    ("a:b:c", "expected an import path"),
    ("stages.builtin.arithmetic_tools.nope", "has no 'nope' (its functions: add, call, result, with_tool)"),
    ("no_such_module_9f.add", "module no_such_module_9f not found"),
    ("stages.builtin.arithmetic_tools.ADD_SCHEMA", "is a dict, not a function"),
    ("stages.tools.runner.ToolRunner", "is a type, not a function"),
])
def test_bad_paths_are_refused_with_the_reason(path, why):
    with pytest.raises(ValueError) as e:
        resolve_tool(path)
    assert why in str(e.value)


def test_problems_name_each_index_and_repeated_names():
    problems = tool_problems(["stages.builtin.arithmetic_tools.add", "nope_mod_3.x",
                              "stages.builtin.arithmetic_tools:add"], key="tools")
    assert [k for k, _ in problems] == ["tools[1]", "tools"]
    assert "['add'] repeat" in problems[1][1]
    assert tool_problems([arithmetic_tools.TOOL_PATH]) == []
