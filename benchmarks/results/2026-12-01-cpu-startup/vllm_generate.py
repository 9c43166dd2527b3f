from vllm import LLM, SamplingParams

if __name__ == "__main__":
    llm = LLM("/tmp/i14-smollm2-hf", max_model_len=2048, enforce_eager=True, dtype="float32")
    params = SamplingParams(max_tokens=1, temperature=0)
    out = llm.generate(["What is the capital of France?"], params)
    print("first token:", repr(out[0].outputs[0].text), flush=True)
