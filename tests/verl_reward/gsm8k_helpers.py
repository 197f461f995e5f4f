import re


def last_hash_answer(text):
    found = re.findall(r"#### (-?[0-9.,]+)", text)
    return found[-1].replace(",", "") if found else None
