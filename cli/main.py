import typer
app = typer.Typer()
@app.command()
def info():
    print("hi")
