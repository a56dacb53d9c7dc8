"""Run with llama.cpp's Python binding, in its own venv (`make llama-cpp`), by
tests/unit/evaluate/test_to_gguf_llama_cpp.py:
for one GGUF file, the ids llama.cpp's tokenizer gives each prompt (a begin-of-sequence id where the file says so)
and llama.cpp's logits for each list of ids, as JSON. Usage: python llama_cpp_worker.py REQUEST.json OUT.json"""

import json
import sys

from llama_cpp import Llama

request = json.loads(open(sys.argv[1]).read())
llm = Llama(model_path=request["gguf"], n_ctx=256, logits_all=True, n_threads=1, verbose=False)
answer = {"tokens": [llm.tokenize(p.encode(), add_bos=True) for p in request["prompts"]], "logits": []}
for ids in request["ids"]:
    llm.reset()
    llm.eval(ids)
    answer["logits"].append(llm.scores[: len(ids)].tolist())
with open(sys.argv[2], "w") as f:
    json.dump(answer, f)
