import json, sys
sys.path.insert(0, '/work/main')
from kiln import LLM
from kiln.eval import gsm8k, wikitext
from kiln.eval.perplexity import rolling_perplexity
llm = LLM(max_num_seqs=16, kv_cache_memory_gb=1.0)
g = gsm8k.run(llm, '/work/shared/data', limit=4, num_fewshot=1, max_gen_toks=48)
test = gsm8k.read_jsonl('/work/shared/data/gsm8k/test.jsonl')[:4]
train = gsm8k.read_jsonl('/work/shared/data/gsm8k/train_head200.jsonl')
prompts = gsm8k.build_prompts(test, train, 1)
from kiln import SamplingParams
outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=48, stop=gsm8k.STOP))
pages = wikitext.load_documents('/work/shared/data')[:1]
w = rolling_perplexity(llm, [wikitext.wikitext_detokenizer(p) for p in pages], max_length=1024, counted_texts=pages)
json.dump({"gsm8k": g, "gsm8k_texts": [o.outputs[0].text for o in outs], "wikitext": w.__dict__}, open('/tmp/lmtask/kiln_side.json', 'w'), indent=1)
print(json.dumps(g), w)
