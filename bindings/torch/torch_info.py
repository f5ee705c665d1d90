"""Prints what CMake needs to build gradcomm's c10d backend against the torch of this interpreter,
one `key=value` per line (lists joined with ';'), or `torch=none` where torch cannot be imported."""
import sysconfig
import warnings

try:
    import torch
    from torch.utils import cpp_extension
except Exception as error:  # noqa: BLE001 (any import failure means: no torch here)
    print("torch=none")
    print(f"why={type(error).__name__}: {error}".replace("\n", " "))
    raise SystemExit(0)

major, minor = (int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
defines = [f"_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
# torch built its own pybind11 types with these; an extension must match them to see the types.
for name in ("COMPILER_TYPE", "STDLIB", "BUILD_ABI"):
    value = getattr(torch._C, f"_PYBIND11_{name}", None)
    if value is not None:
        defines.append(f'PYBIND11_{name}="{value}"')
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    includes = cpp_extension.include_paths()
    libraries = cpp_extension.library_paths()
print("torch=" + torch.__version__)
print(f"major={major}")
print(f"minor={minor}")
print("includes=" + ";".join(includes))
print("libraries=" + ";".join(libraries))
print("defines=" + ";".join(defines))
print("python_include=" + sysconfig.get_paths()["include"])
print("ext_suffix=" + sysconfig.get_config_var("EXT_SUFFIX"))
