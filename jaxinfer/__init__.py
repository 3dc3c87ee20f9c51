"""jaxinfer: a JAX/XLA inference engine for Llama-family language models.

    from jaxinfer import LLM, SamplingParams
    llm = LLM(model="smollm2-135m-instruct")
    print(llm.chat([{"role": "user", "content": "Hi!"}], SamplingParams(temperature=0))[0].outputs[0].text)
"""

from jaxinfer.errors import PromptTooLongError, RequestError
from jaxinfer.llm import LLM
from jaxinfer.outputs import CompletionOutput, RequestOutput
from jaxinfer.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "PromptTooLongError", "RequestError"]
__version__ = "0.1.0"
