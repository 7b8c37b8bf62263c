// Registration macros for the msa torch extension.
//
// kernel-builder generates a header of this name into torch-ext/ when it builds (and refuses
// to overwrite an existing one, so the repository must not track torch-ext/registration.h).
// tools/build_variant.py copies this hand-written equivalent into its private include
// directory instead, where the binding's `#include "registration.h"` finds it, so local
// builds need no kernel-builder. The binding (torch_binding.cpp) uses it as:
//
//   TORCH_LIBRARY_EXPAND(TORCH_EXTENSION_NAME, ops) { ops.def(...); ops.impl(...); }
//   REGISTER_EXTENSION(TORCH_EXTENSION_NAME)
//
// TORCH_EXTENSION_NAME is passed on the command line (-DTORCH_EXTENSION_NAME=_msa_cuda_<id>),
// so the op namespace and the Python module name are the same unique identifier.
//
// Only the CPython limited API (Py_LIMITED_API=0x03090000) is used here: the module is an
// empty abi3 module whose import runs the static TORCH_LIBRARY registrations of the library.

#pragma once

#include <Python.h>

#define MSA_CONCAT_INNER(A, B) A##B
#define MSA_CONCAT(A, B) MSA_CONCAT_INNER(A, B)

#define MSA_STRINGIFY_INNER(A) #A
#define MSA_STRINGIFY(A) MSA_STRINGIFY_INNER(A)

// TORCH_LIBRARY / TORCH_LIBRARY_IMPL paste their NAME argument as a token, so a NAME that is
// itself a macro (TORCH_EXTENSION_NAME) must be expanded by one more level of indirection.
#define TORCH_LIBRARY_EXPAND(NAME, MODULE) TORCH_LIBRARY(NAME, MODULE)
#define TORCH_LIBRARY_IMPL_EXPAND(NAME, DEVICE, MODULE) TORCH_LIBRARY_IMPL(NAME, DEVICE, MODULE)

// Defines PyInit_<NAME>, so `from . import <NAME>` (in the generated _ops.py) loads the shared
// library. The module has no methods and no state: ops are reached through torch.ops.<NAME>.
#define REGISTER_EXTENSION(NAME)                                                   \
  PyMODINIT_FUNC MSA_CONCAT(PyInit_, NAME)(void) {                                 \
    static struct PyModuleDef msa_extension_module = {                            \
        PyModuleDef_HEAD_INIT, MSA_STRINGIFY(NAME), nullptr, 0, nullptr,          \
        nullptr, nullptr, nullptr, nullptr};                                       \
    return PyModule_Create(&msa_extension_module);                                 \
  }
