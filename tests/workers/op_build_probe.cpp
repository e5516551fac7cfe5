// A Python extension module without torch, for tests/runtime/test_op_builds.py: built through
// torch's JIT loader, its build directory and its lock like DeepSpeed's ops, in about a second
// (DeepSpeed's own ops include torch's headers: a minute of compiling each).
#include <Python.h>

#include <complex>
#include <filesystem>
#include <future>
#include <iostream>
#include <random>
#include <regex>
#include <sstream>
#include <unordered_map>
#include <variant>

static struct PyModuleDef probe_module = {PyModuleDef_HEAD_INIT, "toolkit_probe_op", nullptr, -1, nullptr};

PyMODINIT_FUNC PyInit_toolkit_probe_op(void) { return PyModule_Create(&probe_module); }
