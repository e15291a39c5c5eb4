"""Stand-ins for the fastai sample data sets that fastai 1.0.61's training tests download, which this machine cannot:
the same files, columns and folders (`untar_data` finds them and downloads nothing), filled with small learnable data
made here. mnist_tiny's images are scikit-learn's bundled digits 3 and 7."""
from pathlib import Path

import numpy as np
import pandas as pd

_ONES = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
         "seventeen eighteen nineteen").split()
_TENS = "- - twenty thirty forty fifty sixty seventy eighty ninety".split()
_EDUCATION = ["Preschool", "1st-4th", "5th-6th", "7th-8th", "9th", "10th", "11th", "12th", "HS-grad", "Some-college",
              "Assoc-voc", "Assoc-acdm", "Bachelors", "Masters", "Prof-school", "Doctorate"]  # education-num 1..16


def make(home: Path) -> None:
    """FASTAI_HOME `home` with a config and data/{adult_sample,human_numbers,movie_lens_sample,mnist_tiny}; a data set
    already there is kept."""
    data = home / "data"
    data.mkdir(parents=True, exist_ok=True)
    (home / "config.yml").write_text(f"data_archive_path: {data}\ndata_path: {data}\nmodel_path: {home / 'models'}\n")
    for name, maker in (("adult_sample", adult), ("human_numbers", human_numbers), ("movie_lens_sample", movie_lens),
                        ("mnist_tiny", mnist_tiny)):
        if not (data / name).exists():
            tmp = data / f"{name}.tmp"
            tmp.mkdir()
            maker(tmp, np.random.RandomState(0))
            tmp.rename(data / name)


def adult(path: Path, rng, n: int = 2000) -> None:
    """adult.csv: the census columns; salary >=50k mostly for the educated, older and married; 2% of education-num
    missing (fastai's FillMissing) in the first 1000 rows, as test_same_fill_nan expects (it reads rows 1000 on
    as the validation set's)."""
    pick = lambda *values: rng.choice(values, n)  # noqa: E731
    edu = rng.randint(1, 17, n)
    age = rng.randint(17, 80, n)
    relationship = pick("Husband", "Not-in-family", "Own-child", "Unmarried", "Wife")
    score = 0.5 * (edu - 10) + 0.06 * (age - 40) + 1.5 * np.isin(relationship, ["Husband", "Wife"]) + rng.randn(n)
    df = pd.DataFrame({
        "age": age, "workclass": pick("Private", "Self-emp-not-inc", "Local-gov", "State-gov"),
        "fnlwgt": rng.randint(20000, 500000, n), "education": [_EDUCATION[e - 1] for e in edu],
        "education-num": np.where((rng.rand(n) < 0.02) & (np.arange(n) < 1000), np.nan, edu), "marital-status": pick(
            "Married-civ-spouse", "Never-married", "Divorced", "Widowed"),
        "occupation": pick("Exec-managerial", "Craft-repair", "Sales", "Prof-specialty", "Other-service"),
        "relationship": relationship, "race": pick("White", "Black", "Asian-Pac-Islander"),
        "sex": pick("Male", "Female"),
        "capital-gain": 0, "capital-loss": 0, "hours-per-week": rng.randint(20, 60, n),
        "native-country": pick("United-States", "Mexico", "Canada", "India"),
        "salary": np.where(score > 1.5, ">=50k", "<50k")})
    df.to_csv(path / "adult.csv", index=False)


def _words(n: int) -> str:
    """`n` < 10000 in English words, as human_numbers writes them."""
    if n < 20:
        return _ONES[n]
    if n < 100:
        return _TENS[n // 10] + (f" {_ONES[n % 10]}" if n % 10 else "")
    unit, name = (1000, "thousand") if n >= 1000 else (100, "hundred")
    return f"{_words(n // unit)} {name}" + (f" {_words(n % unit)}" if n % unit else "")


def human_numbers(path: Path, rng) -> None:
    """train.txt: one to 7999 in words, a number a line; valid.txt: 8000 to 9999."""
    (path / "train.txt").write_text("".join(f"{_words(i)} \n" for i in range(1, 8000)))
    (path / "valid.txt").write_text("".join(f"{_words(i)} \n" for i in range(8000, 10000)))


def movie_lens(path: Path, rng, users: int = 100, movies: int = 100, per_user: int = 60) -> None:
    """ratings.csv: 100 users rate 60 of 100 movies each, half-star ratings from 3 hidden factors plus noise."""
    u, m = rng.randn(users, 3) * 0.6, rng.randn(movies, 3) * 0.6
    rows = [(user, movie) for user in range(users) for movie in rng.choice(movies, per_user, replace=False)]
    user, movie = np.array(rows).T
    rating = 3.5 + (u[user] * m[movie]).sum(1) + 0.2 * rng.randn(len(rows))
    pd.DataFrame({"userId": user + 1, "movieId": movie + 1, "rating": np.clip(np.round(rating * 2) / 2, 0.5, 5),
                  "timestamp": rng.randint(10 ** 9, 15 * 10 ** 8, len(rows))}).to_csv(path / "ratings.csv", index=False)


def mnist_tiny(path: Path, rng) -> None:
    """{train,valid}/{3,7}/*.png: scikit-learn's digits 3 and 7 as 28x28 RGB; every 4th to valid, the others to train
    three times, each shifted by up to 2 pixels."""
    from PIL import Image
    from sklearn.datasets import load_digits
    digits = load_digits()
    for i, (img, label) in enumerate(zip(digits.images, digits.target)):
        if label not in (3, 7):
            continue
        big = np.asarray(Image.fromarray((img * 255 / 16).astype(np.uint8)).resize((24, 24), Image.BILINEAR))
        split, copies = ("valid", 1) if i % 4 == 0 else ("train", 3)
        for c in range(copies):
            canvas = np.zeros((28, 28), np.uint8)
            dy, dx = rng.randint(0, 5, 2) if c else (2, 2)
            canvas[dy:dy + 24, dx:dx + 24] = big
            (path / split / str(label)).mkdir(parents=True, exist_ok=True)
            Image.fromarray(canvas).convert("RGB").save(path / split / str(label) / f"{i}_{c}.png")
