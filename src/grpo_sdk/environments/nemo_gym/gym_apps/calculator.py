"""grpo-sdk's NeMo-Gym resources server: an add tool and an exact-answer reward (``builtin:calculator``).

A row is ``{"responses_create_params": {"input": [...], "tools": [the add tool]}, "expected_answer": "5"}``.
The tool is ``POST /add {"x": 7, "y": 5}``; its result is written with ``result_format`` (``"{result}"``:
``12``; the tiny model's task uses ``"={result}>"`` and ``modulus: 10``, as grpo-sdk's calculator
environment does). ``/verify`` rewards 1 when the last number of the final assistant message is the
expected answer, and reports ``reward_components`` (``correct``, ``used_tool``) and
``num_tool_calls``. Written with NeMo-Gym's base classes; run in NeMo-Gym's Python (``launch.py``).
"""

import re
from typing import Dict, Optional, Union

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from nemo_gym.base_resources_server import (
    BaseResourcesServerConfig,
    BaseRunRequest,
    BaseVerifyRequest,
    BaseVerifyResponse,
    SimpleResourcesServer,
)

ADD_TOOL = {"type": "function", "name": "add", "description": "Add two integers.", "strict": True,
            "parameters": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                           "required": ["x", "y"], "additionalProperties": False}}


class CalculatorConfig(BaseResourcesServerConfig):
    modulus: Optional[int] = None  # results modulo this (10: every result one digit)
    result_format: str = "{result}"  # how a result is written back to the model


class AddRequest(BaseModel):
    x: int
    y: int


class CalculatorRunRequest(BaseRunRequest):
    expected_answer: Union[str, int]


class CalculatorVerifyRequest(CalculatorRunRequest, BaseVerifyRequest):
    pass


class CalculatorVerifyResponse(BaseVerifyResponse):
    expected_answer: Union[str, int]
    reward_components: Dict[str, float]
    num_tool_calls: int
    final_text: str


class CalculatorResourcesServer(SimpleResourcesServer):
    config: CalculatorConfig

    def setup_webserver(self) -> FastAPI:
        app = super().setup_webserver()  # /seed_session, /verify, /aggregate_metrics, GET /
        app.post("/add")(self.add)
        return app

    async def add(self, body: AddRequest) -> PlainTextResponse:
        result = body.x + body.y
        if self.config.modulus:
            result %= self.config.modulus
        return PlainTextResponse(self.config.result_format.format(result=result))

    async def verify(self, body: CalculatorVerifyRequest) -> CalculatorVerifyResponse:
        output = body.response.output
        texts = [part.text for item in output if item.type == "message" and item.role == "assistant"
                 for part in item.content if getattr(part, "type", None) == "output_text"]
        final = texts[-1] if texts and output[-1].type == "message" else ""
        numbers = re.findall(r"-?\d+", final)
        correct = float(bool(numbers) and numbers[-1] == str(body.expected_answer).strip())
        calls = sum(1 for item in output if item.type == "function_call")
        return CalculatorVerifyResponse(**body.model_dump(), reward=correct, num_tool_calls=calls, final_text=final,
                                        reward_components={"correct": correct, "used_tool": float(calls > 0)})


if __name__ == "__main__":
    CalculatorResourcesServer.run_webserver()
