"""Fixed inputs for the golden data: tokenizer training text, prompts, conversations.

Changing anything here changes every fixture tokenizer and every golden file; rerun
`make golden` and commit the results together.
"""

# English text the tiny fixture tokenizers are trained on. Plain prose with some digits,
# punctuation and line breaks so that merges form for the kinds of text the prompts hold.
TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog. The dog does not mind; it is asleep in the sun.
Once upon a time there was a small village by the sea. The people of the village were fishers,
and every morning they went out on their boats before the sun was up. They came back in the
evening with baskets full of fish, and the whole village ate together by the fire.

A language model reads a sequence of tokens and predicts the next one. During inference the
model first reads the whole prompt at once, which is called prefill, and then writes one token
at a time, which is called decode. The keys and values of past tokens are kept in a cache so
that each new token only needs a small amount of work. Pages of the cache are handed out to
sequences as they grow, and given back when a sequence is finished.

Numbers appear everywhere: 1, 2, 3, 10, 42, 100, 2024, 3.14, 99.9%, $12.50 and 1,000,000.
Dates such as 2024-06-01 and times such as 07:45 or 23:59 are common in text.
Questions end with a question mark? Exclamations end with an exclamation mark!
Some people write "quotes", others write 'single quotes', and (some) use brackets [like] {this}.

Hello! How are you today? I am fine, thank you. What is your name? My name is Ada.
Please tell me a short story about a robot who learns to paint. The robot looked at the sky,
then at the sea, and mixed blue and green until the colours matched what it saw.
The weather today is sunny with a light wind from the west. Tomorrow it will rain.

def add(a, b):
    return a + b

for i in range(10):
    print(i * i)

The history of computing is full of small ideas that became large. A register holds a number,
a memory holds many numbers, and a program tells the machine what to do with them. Good
programs are short, clear and easy to test. Tests compare what a program does with what it
should do, and they are most useful when they are fast and when they fail loudly.

You are a helpful assistant. The user asks a question and the assistant answers it. The
system message sets the rules. The assistant should be kind, short and correct.
"""

# Prompts run through every model: short, long (~100 SmolLM2 tokens, ~200 fixture tokens),
# digits/punctuation, unicode, runs of spaces and tabs, newlines. Index 2's logits are stored at
# every position: 55-70 tokens, well past tiny-mistral's sliding window of 16, yet small on disk.
PROMPTS = [
    "Hello",
    (
        "A language model reads a sequence of tokens and predicts the next one. During "
        "inference the model first reads the whole prompt at once, and then writes one token "
        "at a time. The keys and values of past tokens are kept in a cache made of pages, so "
        "that each new token needs only a small amount of work. When a request finishes, its "
        "pages go back to the pool and another request can use them. Tell me, in a few words, "
        "why this design saves memory when many requests of different lengths run together"
    ),
    "Prices: $12.50, 3,141,592 items; 2024-06-01 at 07:45!! (approx. 99.9%) #42 @home",
    "Café naïve résumé — 日本語のテキスト, emoji 🙂🚀, Ελληνικά и русский",
    "a  b   c    d\t\ttab  end   ",
    "Line one\nLine two\n\n    indented line\nThe end.\n",
]
ALL_POSITIONS_PROMPT_INDEX = 2

CONVERSATIONS = [
    [
        {"role": "system", "content": "You are a terse assistant. Answer in one sentence."},
        {"role": "user", "content": "What is the capital of France?"},
    ],
    [
        {"role": "user", "content": "Hi! Can you count to three?"},
        {"role": "assistant", "content": "Sure: 1, 2, 3."},
        {"role": "user", "content": "Now count backwards from 5."},
        {"role": "assistant", "content": "5, 4, 3, 2, 1."},
        {"role": "user", "content": "Thanks. Write a haiku about the sea."},
    ],
    [
        {"role": "user", "content": "Explain what a KV cache is, briefly."},
    ],
]
