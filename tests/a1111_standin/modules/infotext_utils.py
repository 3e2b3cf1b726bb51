"""Stand-in for ``modules.infotext_utils``: quoting and parsing of the ``key: value, …`` infotext line."""
import json
import re

_PARAM = re.compile(r'\s*([\w][\w \-/]*):\s*("(?:\\.|[^\\"])+"|[^,]*)(?:,|$)')


def quote(text):
    """JSON-quote values that would break the ``key: value, …`` line."""
    if ',' not in str(text) and '\n' not in str(text) and ':' not in str(text):
        return text
    return json.dumps(text, ensure_ascii=False)


def unquote(text):
    if len(text) == 0 or text[0] != '"' or text[-1] != '"':
        return text
    try:
        return json.loads(text)
    except Exception:
        return text


def parse_generation_parameters(x, skip_fields=None):
    """Prompt, negative prompt and the parameters of the last line of an infotext, as a dict of strings."""
    lines = x.strip().split("\n")
    params = {}
    last = lines[-1] if len(_PARAM.findall(lines[-1])) >= 3 else ""
    prompt_lines = lines[:-1] if last else lines
    negative = [ln[len("Negative prompt:"):].strip() for ln in prompt_lines if ln.startswith("Negative prompt:")]
    params["Prompt"] = "\n".join(ln for ln in prompt_lines if not ln.startswith("Negative prompt:"))
    params["Negative prompt"] = negative[0] if negative else ""
    for key, value in _PARAM.findall(last):
        params[key.strip()] = unquote(value.strip())
    for key in skip_fields or []:
        params.pop(key, None)
    return params
