"""The one exception type the converter raises for bad input."""


class ConversionError(ValueError):
    """A checkpoint (or an option) cannot be converted; the message names the file and the tensor."""


def shard_error(path, message: str, tensor: str | None = None) -> ConversionError:
    where = f"{path}" if tensor is None else f"{path}, tensor `{tensor}`"
    return ConversionError(f"{where}: {message}")
